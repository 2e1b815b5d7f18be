"""Process-group set-up from torchrun's environment and the few collectives the trainer needs."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from isotrain.errors import IsotrainError
from isotrain.parallel.dims import launched_by_torchrun, restart_count


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float | None = None  # parallel.timeout_s: how long a rank waits in one collective (None: torch's)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun describes in the environment; a plain process is rank 0 of 1.

    A one-process torchrun launch joins a group of one too, so it runs the code of a many-rank job (its mesh,
    NCCL on a GPU, FSDP2 with parallel.dp_shard=-1). `timeout_s` (parallel.timeout_s) bounds every collective of
    the group: a rank that waits longer for a peer gets an error (gloo) that the run loop turns into one sentence
    naming the silent rank (train/progress.py); NCCL's watchdog ends the process instead."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if (world_size > 1 or launched_by_torchrun()) and not dist.is_initialized():
        options = {}
        if device.type == "cuda":  # bound to this rank's GPU: NCCL's communicators start at once, on the right device
            options["device_id"] = device
        if timeout_s is not None:
            options["timeout"] = timedelta(seconds=timeout_s)
            global _collective_timeout
            _collective_timeout = options["timeout"]
        store = _attempt_store()
        if store is not None:
            options.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **options)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, timeout_s=timeout_s)


_collective_timeout = default_pg_timeout  # the default group's, as init_distributed set it


def _set_timeout(timeout: timedelta, group=None) -> None:
    """A group's collective timeout from now on: torch.distributed.set_timeout, or on a torch without it (2.11,
    found by the CUDA check) the same function under its older name, _set_pg_timeout."""
    setter = getattr(dist, "set_timeout", None)
    if setter is None:
        from torch.distributed.distributed_c10d import _set_pg_timeout as setter
    setter(timeout, group)


@contextlib.contextmanager
def _patient():
    """The default group waits at least torch's 30 minutes inside the block: for a first rank's download or data
    cache (local_main_first), work that parallel.timeout_s, sized for steps, does not bound."""
    if _collective_timeout >= default_pg_timeout:
        yield
        return
    _set_timeout(default_pg_timeout)
    try:
        yield
    finally:
        _set_timeout(_collective_timeout)


def set_timeouts(groups, timeout_s: float | None) -> None:
    """Give `groups` (a mesh's sub-groups, made by torch with its default timeout) the run's collective timeout."""
    if timeout_s is None or not dist.is_initialized():
        return
    for group in groups:
        _set_timeout(timedelta(seconds=timeout_s), group)


# How a gloo collective fails when a peer does not take part: it times out, or the peer that timed out first
# closes its connections. Raised as RuntimeError (DistBackendError and its kin are RuntimeErrors too).
_PEER_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer")


def failed_collective(err: BaseException) -> str | None:
    """"timed out" or "failed" when `err` is a collective that a peer did not complete; None for any other error."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if "imed out" in text:
        return "timed out"
    if isinstance(err, dist.DistError) or any(words in text for words in _PEER_FAILURES):
        return "failed"
    return None


def _attempt_store():
    """The store this start of the workers meets in: torchrun's own, under a prefix of its restart count.

    torchrun's elastic agent serves one TCPStore (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) for
    the whole job: a restart under --max-restarts reuses it, and the keys that the killed workers' process groups
    wrote there are still set. Without a prefix, a restarted worker reads its dead peer's address (gloo's
    connectFullMesh, NCCL's unique id) instead of waiting for the new peer's, and fails to connect or hangs
    (pytorch/pytorch#135712). None without an agent store: init_process_group's env:// store is then new per start.
    The restart count is the agent's; every worker of a node shares it (see docs/resume.md for several nodes)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=default_pg_timeout)
    return dist.PrefixStore(f"isotrain/attempt-{restart_count()}", store)


def shutdown_distributed() -> None:
    """Leave the process group (called from `finally` blocks).

    On a normal exit every rank first waits for the others: a rank that closes its connections while a peer is
    still finishing the last collective resets that peer's connection. While an error unwinds there is no such
    wait (the other ranks may never arrive). Objects that hold process groups (wrapped models, meshes) are then
    collected while the interpreter is fully alive: gloo's threads torn down during interpreter finalisation
    abort the process."""
    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over the group; a no-op without a process group."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def all_reduce_max(value: int, group, device: torch.device) -> int:
    """The largest of every rank's `value` over the group; `value` itself without a process group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    values = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return int(values.item())


def any_rank(device: torch.device, *flags: bool) -> list[bool]:
    """Each flag is True on every rank if it is True on any rank (one all-reduce for all of them)."""
    values = all_reduce_sum(torch.tensor([int(flag) for flag in flags], dtype=torch.int64, device=device))
    return [bool(value) for value in values.tolist()]


def all_reduce_flat(tensors: list[torch.Tensor], group=None) -> None:
    """Sum each tensor over `group` in place, with one all-reduce of their concatenation (one call, not one
    per tensor)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def local_main_first(local_rank: int, work, shared_dir: Path | None = None):
    """`work(first=True)` on each machine's local rank 0, then `work(first=False)` on every other rank, which finds
    the first runs' files in place (a download or a cache built once per machine, not once per rank). An
    IsotrainError of a first run is raised on every rank, the same sentence, rather than leaving the others
    waiting for it. Without a process group (one process), `work(first=True)`.

    `shared_dir`: a directory the work writes into, which several machines may share. Rank 0 then writes a probe
    file into it, and only those local ranks 0 that cannot see the probe run first besides rank 0: a directory on
    a shared file system is built once for the job, a node-local one once per machine. A machine that sees the
    probe late (attribute caching on a network file system) runs first too, which costs time, not correctness:
    the work must commit atomically, as the caches' does. Without it, every machine's first rank runs first (the
    Hub client locks what it writes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work(True)
    rank, probe = dist.get_rank(), None
    first = local_rank == 0
    if shared_dir is not None:
        shared_dir.mkdir(parents=True, exist_ok=True)
        probe = shared_dir / broadcast_from_main(f".isotrain-probe-{uuid.uuid4().hex}")
        if rank == 0:
            probe.write_text("")
        dist.barrier()
        first = rank == 0 or (first and not probe.exists())
    result, error = None, None
    if first:
        try:
            result = work(True)
        except IsotrainError as err:
            error = err
    errors = [None] * dist.get_world_size()
    with _patient():
        dist.all_gather_object(errors, error)  # also the wait: no rank passes before every first run is done
    if probe is not None and rank == 0:
        probe.unlink(missing_ok=True)
    first_error = next((err for err in errors if err is not None), None)
    if first_error is not None:
        raise first_error
    return result if first else work(False)


def gather_from_all(value) -> list:
    """Every rank's `value` (any picklable object) on every rank, in rank order; [value] without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def twin_group(group, timeout_s: float | None = None):
    """A gloo group with the ranks of `group` (None: the world), for the collectives a background thread issues
    beside the trainer's: two threads must never share a group, whose collectives would interleave differently on
    different ranks. Every rank calls it (each DP group gets its twin); None without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else _collective_timeout
    mine = None
    for ranks in sorted(set(gather_from_all(members))):  # the same order on every rank, as new_group needs
        made = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks:
            mine = made
    return mine


def broadcast_from_main(value):
    """Rank 0's `value` (any picklable object) on every rank; the value itself without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_in_group(value, group):
    """The `value` (any picklable object) of the first rank of `group` on every rank of it; the value itself when
    `group` is None (no such group) or a group of one."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box = [value if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
