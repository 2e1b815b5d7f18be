"""Write a checkpoint directory: every rank writes its share of the tensors, rank 0 commits.

No rank holds the whole model: each tensor has one owner rank (balanced by bytes, `assign_owners`)
that writes it. A sharded tensor (FSDP2, TP, both) travels to its owner alone, each other box of it
sent once point to point into a buffer of its size, up to `transfer_budget` bytes of tensors in flight,
so a rank's extra memory is bounded by the tensors it owns that are in transit. Files are written
by `StreamingFile` (stream.py), which hashes the bytes as they go, so the manifest costs no extra
read.

Commit protocol (invariant 5): write into `step-XXXXXXXX.tmp-<id>/`, fsync every file; gather
every rank's file list (a barrier); rank 0 writes the indexes, state and manifest, fsyncs the
directory, renames it to `step-XXXXXXXX/`, fsyncs the parent and only then updates `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from isotrain.checkpoint.files import CHUNK_BYTES, FileEntry, safetensors_header, tensor_view, write_chunks
from isotrain.checkpoint.layout import (
    LATEST,
    checkpoints_root,
    committed as committed_steps,
    step_dir_name,
    write_latest,
)
from isotrain.checkpoint.manifest import MODEL_INDEX, OPTIMIZER_INDEX, write_manifest
from isotrain.checkpoint.state import Item
from isotrain.checkpoint.stream import StreamingFile
from isotrain.disk import commit, fsync_dir
from isotrain.errors import CheckpointError
from isotrain.parallel.boxes import box_index, is_empty

@dataclass
class SaveRequest:
    """Everything one save writes, already collected (and, for async saves, staged in host memory)."""

    step: int
    items: list[Item]
    rank_files: dict[str, bytes]  # written by this rank (its RNG state)
    main_files: dict[str, bytes] = field(default_factory=dict)  # written by rank 0 (config, tokenizer, state)
    info: dict = field(default_factory=dict)  # manifest fields: kind, step, layout
    # Bytes of tensors on their way to their owners beyond the one being written. Ranks write in
    # parallel only while transfers run ahead (a rank waits for its peers' progress otherwise); 0
    # keeps an async save, which already holds a host copy of the rank's shard, within one tensor.
    transfer_budget: int = 256 << 20
    # Bytes of each of a file's two write buffers (a multiple of 4096): smaller for async saves, whose
    # memory bound their host copy already fills.
    piece_bytes: int = CHUNK_BYTES


def plan_files(items: list[Item]) -> dict[str, list[Item]]:
    """Relative file name -> its tensors in write order: one model and one optimizer file per owner rank."""
    files: dict[str, list[Item]] = {}
    for kind, prefix in (("model", "model"), ("optimizer", "train_state/optimizer")):
        owners = sorted({item.owner for item in items if item.kind == kind})
        for index, owner in enumerate(owners):
            name = f"{prefix}.safetensors" if len(owners) == 1 else (
                f"{prefix}-{index + 1:05d}-of-{len(owners):05d}.safetensors")
            files[name] = [item for item in items if item.kind == kind and item.owner == owner]
    return files


def index_files(files: dict[str, list[Item]]) -> dict[str, bytes]:
    """`model.safetensors.index.json` when the model spans several files; the optimizer's index always."""
    out = {}
    for index_name, prefix in ((MODEL_INDEX, "model"), (OPTIMIZER_INDEX, "train_state/optimizer")):
        names = [name for name in files if name.startswith(prefix + ".") or name.startswith(prefix + "-")]
        if not names or (index_name == MODEL_INDEX and len(names) == 1):
            continue
        weight_map = {item.key: Path(name).name for name in names for item in files[name]}
        total = sum(item.num_bytes for name in names for item in files[name])
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        out[index_name] = (json.dumps(doc, indent=2) + "\n").encode()
    return out


@dataclass
class _Transfer:
    """One tensor on its way to its owner: there, its pieces in file order (complete once `works` are
    done and `fills` copied); None elsewhere."""

    item: Item
    pieces: list[torch.Tensor] | None
    works: list
    sent: torch.Tensor | None = None  # kept alive until the send completes
    fills: list[tuple[tuple[slice, ...], torch.Tensor]] = field(default_factory=list)  # received box -> its place

    def complete(self) -> list[torch.Tensor] | None:
        """Wait for the transfers; the owner gets the pieces to write."""
        for work in self.works:
            work.wait()
        if self.pieces is not None:
            for index, received in self.fills:
                self.pieces[0][index] = received
        return self.pieces


def _start_transfer(item: Item, rank: int, group) -> _Transfer:
    """Start moving `item` to its owner; every rank calls this for every item, in the same order.

    Each distinct box travels once, from its first holder, point to point into a buffer of its
    size on the owner. Row blocks (boxes that differ only along dim 0) lie one after the other in
    the file: the owner writes its own block from where it lies and each received block as it is,
    so its extra memory is the tensor minus its own rows and nothing is copied twice. Any other
    boxes (TP's column split, 2-D layouts) are assembled into one full tensor on the owner: its
    extra memory is then that tensor plus the boxes in flight, at most twice the tensor.
    """
    spec = item.shard
    if spec is None:  # every rank holds it whole
        return _Transfer(item, [item.local] if rank == item.owner else None, [])
    if rank != item.owner:
        if not spec.sends(rank, item.owner):
            return _Transfer(item, None, [])
        sent = item.local.contiguous().cpu()  # the transfer group is gloo, which sends host memory
        return _Transfer(item, None, [dist.isend(sent, dst=item.owner, group=group)], sent)
    own = spec.box_of_rank[rank]
    rows = spec.row_blocks
    full = None if rows else torch.empty(item.shape, dtype=item.local.dtype)
    pieces, works, fills = [] if rows else [full], [], []
    for index, (box, source) in enumerate(zip(spec.boxes, spec.holders)):
        if is_empty(box):
            continue
        if index == own:
            received = item.local
        else:
            received = torch.empty([stop - start for start, stop in box], dtype=item.local.dtype)
            works.append(dist.irecv(received, src=source, group=group))
        if rows:
            pieces.append(received)
        elif index == own:
            full[box_index(box)] = received
        else:
            fills.append((box_index(box), received))
    return _Transfer(item, pieces, works, fills=fills)


def write_order(files: dict[str, list[Item]]) -> list[Item]:
    """Every item once, in an order where all files advance together: next comes the file with the
    smallest share of its bytes already scheduled. Each file keeps its own tensor order, so every
    file (of every rank) has bytes to hash and write at each moment, and one process's files are
    hashed on as many threads. The same on every rank (it depends on the plan only)."""
    totals = {name: max(1, sum(item.num_bytes for item in its)) for name, its in files.items()}
    done = dict.fromkeys(files, 0)
    queues = {name: deque(its) for name, its in files.items()}
    order = []
    for _ in range(sum(len(its) for its in files.values())):
        name = min((n for n in files if queues[n]), key=lambda n: (done[n] / totals[n], n))
        order.append(item := queues[name].popleft())
        done[name] += item.num_bytes
    return order


def write_tensor_files(directory: Path, items: list[Item], rank: int, group, transfer_budget: int = 256 << 20,
                       direct: bool = True, piece_bytes: int = CHUNK_BYTES) -> dict[str, FileEntry]:
    """Write this rank's files. Transfers run ahead of the writes (up to `transfer_budget` bytes of
    tensors), so a rank's disk writes, its peers' and the network overlap. A write error is raised only after the loop, so
    that every rank still takes part in every transfer and none is left waiting."""
    files = plan_files(items)
    mine = {name: its for name, its in files.items() if its[0].owner == rank}
    file_of = {item.key: name for name, its in mine.items() for item in its}
    open_files: dict[str, StreamingFile] = {}
    error: OSError | None = None

    def finish(transfer: _Transfer) -> None:
        nonlocal error
        pieces = transfer.complete()
        if pieces is None or error is not None:
            return
        try:
            item = transfer.item
            for piece in pieces:
                # Cast where the tensor lives (a GPU casts fast and copies fewer bytes), then bring it to host memory.
                open_files[file_of[item.key]].append(tensor_view(piece.to(item.dtype).cpu()))
        except OSError as err:
            error = err

    try:
        for name, its in mine.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            header = safetensors_header({i.key: _meta(i) for i in its})
            size = len(header) + sum(i.num_bytes for i in its)
            open_files[name] = StreamingFile(directory / name, header, size, direct, piece_bytes)
    except OSError as err:
        error = err
    pending: deque[_Transfer] = deque()
    ahead = 0
    for item in write_order(files):
        pending.append(_start_transfer(item, rank, group))
        ahead += item.num_bytes
        while pending and ahead > transfer_budget:
            done = pending.popleft()
            ahead -= done.item.num_bytes
            finish(done)
    while pending:
        finish(pending.popleft())
    entries = {}
    for name, handle in open_files.items():
        if error is not None:
            handle.abort()
            continue
        try:
            entries[name] = handle.close()
        except OSError as err:
            error = err
    if error is not None:
        raise error
    return entries


def _meta(item: Item) -> torch.Tensor:
    """A zero-storage tensor with the item's shape and dtype, for building headers."""
    return torch.empty(item.shape, dtype=item.dtype, device="meta")


def write_request(directory: Path, request: SaveRequest, rank: int, group) -> dict[str, FileEntry]:
    """This rank's part of a save (tensor shares, its own small files; rank 0 also the shared ones)."""
    entries = write_tensor_files(directory, request.items, rank, group, request.transfer_budget,
                                 piece_bytes=request.piece_bytes)
    small = dict(request.rank_files)
    if rank == 0:
        small.update(request.main_files)
        small.update(index_files(plan_files(request.items)))
    for name, data in small.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        entries[name] = write_chunks(directory / name, [data])
    return entries


def _exchange(payload, rank: int, group) -> list | None:
    """Gather one object per rank on rank 0 (this is the save's barrier)."""
    if group is None or dist.get_world_size(group) == 1:
        return [payload]
    gathered = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0, group=group)
    return gathered


def broadcast_in_group(value, rank: int, group):
    """The group's first rank's `value` (any picklable object) on every rank of `group` (None: this process alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save(root: Path, request: SaveRequest, rank: int, group, run_id: str, name: str | None = None) -> Path:
    """Write and commit one checkpoint under `root` (as `name`, else `step-XXXXXXXX` and `latest`);
    returns the committed directory on every rank."""
    final = root / (name or step_dir_name(request.step))
    tmp = root / f"{final.name}.tmp-{run_id}"
    message = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            message = f"could not create {tmp}: {err.strerror or err}"
    message = broadcast_in_group(message, rank, group)  # the directory exists before any rank writes into it
    committed = False
    if message is None:
        try:
            outcome: dict | str = write_request(tmp, request, rank, group)
        except OSError as err:
            outcome = f"rank {rank} could not write {err.filename or tmp} ({err.strerror or err})"
        gathered = _exchange(outcome, rank, group)
        if rank == 0:
            failures = [o for o in gathered if isinstance(o, str)]
            message, committed = (failures[0], False) if failures else _commit(
                root, tmp, final, gathered, request.info, run_id, latest=name is None)
            if message and not committed:
                shutil.rmtree(tmp, ignore_errors=True)
        message, committed = broadcast_in_group((message, committed), rank, group)
    if message:
        # The final model/ is saved here too (with step 0): the sentence names what was not saved.
        what = f"checkpoint step {request.step}" if name is None else f"the model directory {final}"
        if committed:
            raise CheckpointError(f"{final} was saved, but {message}; free disk space or fix the path "
                                  "(resume=auto finds the newest valid checkpoint without it)")
        # Only claim what is true: a first save that fails leaves no earlier checkpoint behind.
        earlier = committed_steps(root if name is None else checkpoints_root(root))
        kept = " (earlier checkpoints are intact)" if earlier else ""
        raise CheckpointError(f"{what} was not saved: {message}; free disk space or fix the path{kept}")
    return final


def _commit(root: Path, tmp: Path, final: Path, gathered: list[dict], info: dict, run_id: str,
            latest: bool) -> tuple[str | None, bool]:
    """Rank 0: manifest, fsync, atomic rename, `latest`. Returns (error message or None, whether the
    checkpoint is committed): once renamed it is, even if `latest` then cannot be written."""
    try:
        entries = {name: entry for part in gathered for name, entry in part.items()}
        write_manifest(tmp, entries, info)
        for directory in sorted({(tmp / name).parent for name in entries} - {tmp}, reverse=True):
            fsync_dir(directory)  # subdirectories (train_state/); `commit` syncs tmp itself
        # A stale copy of this step (e.g. after resuming from an older one) is set aside as `.old-`.
        commit(tmp, final, aside=f"old-{run_id}")
    except OSError as err:
        if final.is_dir() and not tmp.exists():  # renamed: committed, only the parent's fsync failed
            return f"{root} could not be synced ({err.strerror or err})", True
        return f"could not commit {final} ({err.strerror or err})", False
    try:
        if latest:
            write_latest(root, final.name)
    except OSError as err:
        return f"{root / LATEST} could not be updated ({err.strerror or err})", True
    return None, True


def rotate(root: Path, keep_last: int, keep_every: int | None) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last` (milestones kept); called after a commit.

    Each is first renamed to `.old-` (atomic), so a crash mid-delete never leaves a directory with
    a committed name and missing files.
    """
    from isotrain.checkpoint.layout import committed

    removed = []
    checkpoints = committed(root)
    for step, path in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if keep_every and step % keep_every == 0:
            continue
        doomed = path.with_name(f"{path.name}.old-rotate")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed
