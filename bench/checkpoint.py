"""Checkpoint speed and memory, side by side: the disk itself, isotrain, torch.distributed.checkpoint
(DCP) and `save_pretrained` + `torch.save(optimizer)`.

The state is a fresh Llama built by isotrain (`build_config` with a `model.config` mapping, then the
trainer's own `prepare_model`: default hidden 768, 12 layers, intermediate 1664, vocab 32000, untied
embeddings, about 123M parameters, fp32) with isotrain's AdamW after one real step, so the
checkpoint holds the weights and both moments (12 bytes per parameter, about 1.5 GB). Each
operation runs in fresh processes, 1 rank or 2 FSDP2 ranks on gloo (`fully_shard` applied by
isotrain's `parallelize`), so that each one's peak memory is its own. It runs --repeats times; the
table shows medians.

    s          wall time of the slowest rank, from a barrier before to a barrier after
    GB         bytes of the checkpoint written or read (for DCP's HF writer: the model only)
    GB/s       GB / s
    disk GB/s  the disk's own speed with the same bytes, measured right before and right after each
               repeat in the same processes. Saves: every rank writes the tensor bytes it would save
               to a plain file in 16 MB pieces and fsyncs, once through the page cache and once
               with direct I/O; the faster of the two is the limit (the header line shows both).
               Loads (and verify): every rank reads its share of the very files the load reads,
               cold (dropped from the page cache with posix_fadvise(DONTNEED)), in 16 MB pieces.
               This disk's speed drifts by 2x or more within a minute, so each repeat is compared
               with the mean of its two neighbours.
    x disk     GB/s over disk GB/s (write for saves, read for loads), median over repeats
    blocked s  async saves only: the time the training loop cannot run, i.e. the save call plus the
               wait for staging before the next optimizer update, with no training work to overlap
               (the worst case); for the first save of a run / the median of the later ones. The
               first save comes after one more training step and the first disk probe (a few
               seconds), time in which the manager allocates its host buffers in the background, as
               it does in a run from the second update on
    peak RSS   VmHWM of each rank during the operation (reset before it; counts mapped file pages)
    extra      peak anonymous memory (RssAnon, sampled every 2 ms) minus the value before the
               operation, with the model and optimizer state already built; next to the bound isotrain
               promises: the largest tensor the rank owns plus its own shard of the state; for
               async saves it includes the kept host buffers, allocated before the first save

Every load is cold: the checkpoint is fsynced and dropped from this machine's page cache first (the
virtual machine's host may still cache it; the disk probe's reads are treated the same way).
isotrain's saves include the BLAKE3 digests of every byte and the commit (fsync, atomic rename). Its
load rows are `load_model` + `load_optimizer` alone; its resume rows add every check a resume makes
(manifest, sizes, headers, and each 16 MiB piece's BLAKE3, hashed from the loaded tensors or read
for what no rank loaded), the number the resume target is about. DCP saves use `FileSystemWriter` (sync_files=True, one thread); every DCP and Hugging Face
save is fsynced before its clock stops, so all rows measure durable checkpoints.

    python bench/checkpoint.py [--hidden 768] [--layers 12] [--repeats 3] [--dir /tmp] [--skip-dcp]
    python bench/checkpoint.py --hidden 128 --layers 2 --intermediate 256 --vocab 4000 --repeats 2  # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.markup import escape
from rich.table import Table

CHUNK = 16 << 20
TARGET_SAVE, TARGET_BLOCKED, TARGET_LOAD = 0.85, 0.10, 0.8


# ----- measurement helpers -----------------------------------------------------------------
def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: Path) -> None:
    """Drop a file (or every file of a directory) from the page cache, so the next read is cold."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of a checkpoint directory (DCP's `sharded/` scratch copy of a consolidated save excluded)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "sharded" not in p.parts)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def probe_disk(path: Path, views: list[memoryview]) -> dict:
    """The disk's write limit for these bytes on this rank: the faster of a plain write + fsync
    through the page cache and a direct-I/O write + fsync (`write_direct`).

    Every rank probes at once (barriers), so with 2 ranks the writes overlap as a 2-rank save's do.
    The files are kept until the row ends: deleting them here would make the next fsync pay for the
    discard of their blocks (this file system is mounted with `discard`).
    """
    barrier()
    start, num_bytes = time.perf_counter(), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for view in views:
        for offset in range(0, len(view), CHUNK):
            piece = view[offset : offset + CHUNK]
            while len(piece):
                piece = piece[os.write(fd, piece):]
        num_bytes += len(view)
    os.fsync(fd)
    os.close(fd)
    buffered_s = time.perf_counter() - start
    barrier()
    direct_s = write_direct(path.with_name(path.name + ".direct"), views, num_bytes)
    barrier()
    return {"bytes": num_bytes, "write_s": min(buffered_s, direct_s), "buffered_write_s": buffered_s,
            "direct_write_s": direct_s}


def write_direct(path: Path, views: list[memoryview], num_bytes: int) -> float:
    """Seconds to write the same bytes with direct I/O and fsync: copied piece by piece into three
    page-aligned 16 MB buffers (direct I/O needs alignment), two pieces in flight while the third
    fills; the last piece is rounded up to whole pages."""
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    buffers, pending = [mmap.mmap(-1, CHUNK, flags=private) for _ in range(3)], deque()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    start, offset, fill = time.perf_counter(), 0, 0
    with ThreadPoolExecutor(max_workers=2) as writers:
        def submit() -> None:
            nonlocal offset, fill
            buffer = buffers[offset // CHUNK % 3]
            pending.append(writers.submit(os.pwrite, fd, memoryview(buffer)[: -(-fill // 4096) * 4096], offset))
            offset, fill = offset + CHUNK, 0

        for view in views:
            view, position = view.cast("B"), 0
            while position < len(view):
                if fill == 0 and len(pending) == 3:
                    pending.popleft().result()
                count = min(CHUNK - fill, len(view) - position)
                buffers[offset // CHUNK % 3][fill : fill + count] = view[position : position + count]
                fill, position = fill + count, position + count
                if fill == CHUNK:
                    submit()
        if fill:
            submit()
        for future in pending:
            future.result()
    os.fsync(fd)
    os.close(fd)
    assert offset >= num_bytes
    return time.perf_counter() - start


class AnonPeak:
    """Peak anonymous resident memory (RssAnon) while active, sampled every 2 ms by a thread.

    Anonymous memory is what an operation allocates; file pages it maps or reads are page cache,
    which VmHWM counts too.
    """

    def __enter__(self):
        self.base = self.peak = rss_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes("RssAnon"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.extra = max(self.peak, rss_bytes("RssAnon")) - self.base


# ----- the state under test ----------------------------------------------------------------
def llama(args) -> dict:
    heads = max(1, args.hidden // 64)
    return {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": args.intermediate,
            "vocab_size": args.vocab, "tie_word_embeddings": False, "max_position_embeddings": 256}


def build(args, world_size: int, output_dir: Path, async_save: bool = False):
    """isotrain's own model, optimizer (after one real AdamW step) and checkpoint manager for this rank."""
    from isotrain.checkpoint.manager import CheckpointContract, CheckpointManager
    from isotrain.config import build_config
    from isotrain.models.tokenizer import train_tokenizer
    from isotrain.parallel.dist import init_distributed
    from isotrain.parallel.dims import resolve_dims
    from isotrain.parallel.mesh import build_parallel
    from isotrain.train.setup import prepare_model

    cfg = build_config({
        "output_dir": str(output_dir),
        "model": {"config": llama(args)},
        "tokenizer": {"type": "char"},
        "parallel": {"dp_replicate": 1, "dp_shard": world_size},
        "train": {"global_batch_size": 2 * world_size, "micro_batch_size": 1, "max_steps": 10},
        "checkpoint": {"every_steps": 1, "keep_last": 100, "async": async_save},
        "eval": {"path": None},
    })
    info = init_distributed()
    degrees = resolve_dims(cfg.parallel, world_size)
    tokenizer = train_tokenizer(["abcdefghijklmnopqrstuvwxyz 0123456789"], "char", cfg.tokenizer.vocab_size)
    model, optimizer = prepare_model(cfg, info, tokenizer, build_parallel(degrees, info.device, info.rank))
    # Real AdamW state: both moments and the step count, so the optimizer files have their real size.
    train_step(args, model, optimizer)
    layout = {"world_size": world_size, **dict(degrees.as_rows())}
    manager = CheckpointManager(cfg, info.rank, world_size, layout, model, optimizer, tokenizer,
                                CheckpointContract(extra_state={"bench": True}), log=lambda *a: None)
    return info, model, optimizer, manager


def train_step(args, model, optimizer, manager=None) -> None:
    """One real AdamW step on a fixed sequence; `manager.before_update` runs where a training loop calls it."""
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    if manager is not None:
        manager.before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def own_state(model, optimizer, rank: int, world_size: int, kinds=("model", "optimizer")) -> tuple[list, dict]:
    """The bytes this rank holds of the checkpoint (for the disk probe) and its memory bound.

    bound = the largest tensor it owns (gathered whole to be written) + its own shard of the state
    (what an async save stages), from the same ownership plan the save uses.
    """
    from isotrain.checkpoint.files import tensor_view
    from isotrain.checkpoint.state import assign_owners, collect_items

    items = collect_items(model, optimizer, torch.float32)
    assign_owners(items, world_size)
    mine = [i for i in items if i.kind in kinds and (i.shard is not None or i.owner == rank)]
    largest = max((i.num_bytes for i in items if i.owner == rank), default=0)
    own = sum(i.local.numel() * i.local.element_size() for i in items if i.shard is not None or i.owner == rank)
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global count
    return [tensor_view(i.local) for i in mine], {"bound": largest + own, "num_params": num_params}


def probe_read(source: Path, rank: int) -> dict:
    """The disk's read limit for a load: a plain cold read of the source checkpoint's own files, each
    rank an equal share of their bytes, in 16 MB pieces into one reused buffer.

    Reading the loaded files themselves keeps the comparison fair: a file written moments ago reads
    about twice as fast here as one written minutes ago (the virtual machine's host still caches
    it), so a fresh probe file would flatter the disk.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    files = sorted(p for p in source.rglob("*") if p.is_file())
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    first, last = total * rank // world_size, total * (rank + 1) // world_size
    if rank == 0:
        evict(source)
    barrier()
    buffer, offset, start = bytearray(CHUNK), 0, time.perf_counter()
    for path, size in zip(files, sizes):
        begin, end = max(first, offset) - offset, min(last, offset + size) - offset
        if begin < end:
            fd = os.open(path, os.O_RDONLY)
            while begin < end:
                begin += os.preadv(fd, [memoryview(buffer)[: min(CHUNK, end - begin)]], begin)
            os.close(fd)
        offset += size
    read_s = time.perf_counter() - start
    barrier()
    return {"bytes": last - first, "read_s": read_s}


def repeat(args, rank: int, work: Path, views: list, fn, evict_first: Path | None = None) -> dict:
    """Probe the disk, then (run `fn`, probe the disk) args.repeats times. Loads (`evict_first`, the
    checkpoint they read) are compared with a plain read of that checkpoint's files."""
    def probe(r: int) -> dict:
        if evict_first is not None:
            return probe_read(evict_first, rank)
        return probe_disk(work / f"probe-{r}-rank{rank}.bin", views)

    probes, seconds, blocked, extra, peak = [probe(0)], [], [], 0, 0
    for r in range(args.repeats):
        if evict_first is not None and rank == 0:
            evict(evict_first)
        gc.collect()
        barrier()
        reset_peak_rss()
        with AnonPeak() as memory:
            start = time.perf_counter()
            waited = fn(r)
            barrier()
            seconds.append(time.perf_counter() - start)
        peak, extra = max(peak, rss_bytes("VmHWM")), max(extra, memory.extra)
        if waited is not None:
            blocked.append(waited)
        probes.append(probe(r + 1))
    return {"seconds": seconds, "probes": probes, "blocked": blocked or None, "extra": extra, "peak": peak}


# ----- operations (each in fresh processes) ------------------------------------------------
def op_isotrain_save(args, ws, work: Path, async_save: bool) -> dict:
    info, model, optimizer, manager = build(args, ws, work / "run", async_save)
    views, facts = own_state(model, optimizer, info.rank, ws)
    if async_save:
        # A run's first save comes after at least one more training step; during that step the
        # manager allocates its host buffers in the background (started at the update).
        train_step(args, model, optimizer, manager)

    def save(r: int):
        start = time.perf_counter()
        manager.save(r + 1, {"tokens_seen": 0, "trained_tokens": 0, "samples_seen": 0})
        manager.before_update()  # what the next step waits for: nothing for a sync save, staging for async
        blocked = time.perf_counter() - start
        manager.wait()
        return blocked if async_save else None

    result = repeat(args, info.rank, work, views, save)
    # The kept host buffers were allocated before the measured saves, but each save uses them.
    result["extra"] += manager.staging_bytes if async_save else 0
    return {**result, **facts}


def op_isotrain_load(args, ws, work: Path, source: str) -> dict:
    from isotrain.checkpoint.load import CheckpointReader, load_model, load_optimizer

    info, model, optimizer, _ = build(args, ws, work / "load-run")
    views, facts = own_state(model, optimizer, info.rank, ws)

    def load(_r: int):
        reader = CheckpointReader(work / source)
        load_model(reader, model, info.rank)
        load_optimizer(reader, model, optimizer, info.rank)  # new moments; the old ones are freed one by one
        reader.close()

    return {**repeat(args, info.rank, work, views, load, work / source), **facts}


def op_isotrain_resume(args, ws, work: Path, source: str) -> dict:
    """What `CheckpointManager.resume` does to a checkpoint, without the run's own checks of state.json:
    rank 0 checks the manifest, sizes, small files and headers, every rank loads its part, then the
    tensor data is checked piece by piece (BLAKE3), from the loaded memory and, for what no rank
    read, from disk (isotrain/checkpoint/onepass.py)."""
    from isotrain.checkpoint.load import CheckpointReader, load_model, load_optimizer
    from isotrain.checkpoint.manifest import verify_checkpoint
    from isotrain.checkpoint.onepass import check_loaded

    info, model, optimizer, _ = build(args, ws, work / "resume-run")
    views, facts = own_state(model, optimizer, info.rank, ws)

    def resume(_r: int):
        if info.rank == 0:
            problems = verify_checkpoint(work / source, defer_tensor_data=True)
            if problems:
                raise RuntimeError(problems[0])
        barrier()
        reader = CheckpointReader(work / source, record=True)
        load_model(reader, model, info.rank)
        load_optimizer(reader, model, optimizer, info.rank)
        problem = check_loaded(work / source, reader.loaded, info.rank, ws, None)
        reader.close()
        if problem:
            raise RuntimeError(problem)

    return {**repeat(args, info.rank, work, views, resume, work / source), **facts}


def op_verify(args, ws, work: Path, source: str) -> dict:
    from isotrain.checkpoint.manifest import verify_checkpoint

    info, model, optimizer, _ = build(args, ws, work / "verify-run")
    views, _ = own_state(model, optimizer, info.rank, ws)

    def verify(_r: int):
        problems = verify_checkpoint(work / source)
        if problems:
            raise RuntimeError(problems[0])

    return repeat(args, info.rank, work, views, verify, work / source)


def op_dcp_save(args, ws, work: Path, writer: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    info, model, optimizer, _ = build(args, ws, work / "dcp-run")
    views, _ = own_state(model, optimizer, info.rank, ws, ("model",) if writer == "hf" else ("model", "optimizer"))

    def save(r: int):
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = work / f"dcp-{writer}" / f"ws{ws}-{r}"
        if writer == "hf":  # a writer for Hugging Face model weights: the model only
            storage = dcp.HuggingFaceStorageWriter(str(target), save_distributed=ws > 1, enable_consolidation=ws > 1)
            dcp.save(model_sd, storage_writer=storage)
        elif writer == "async":
            future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target))
            blocked = time.perf_counter() - start
            future.result()
        else:
            storage = dcp.FileSystemWriter(target, sync_files=True)
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=storage)
        barrier()
        if info.rank == 0:
            fsync_tree(target)  # durable, as the other rows (mostly already synced)
        return blocked if writer == "async" else None

    return repeat(args, info.rank, work, views, save)


def op_dcp_load(args, ws, work: Path, source: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    info, model, optimizer, _ = build(args, ws, work / "dcp-load-run")  # DCP loads into existing state
    views, _ = own_state(model, optimizer, info.rank, ws)

    def load(_r: int):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(work / source))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return repeat(args, info.rank, work, views, load, work / source)


def op_hf_save(args, ws, work: Path) -> dict:
    info, model, optimizer, _ = build(args, ws, work / "hf-run")
    views, _ = own_state(model, optimizer, info.rank, ws)

    def save(r: int):
        target = work / f"hf-{r}"
        model.save_pretrained(target, safe_serialization=True)
        torch.save(optimizer.state_dict(), target / "optimizer.pt")
        fsync_tree(target)  # save_pretrained and torch.save return before the bytes are durable

    return repeat(args, info.rank, work, views, save)


def op_hf_load(args, ws, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from isotrain.train.optim import build_optimizer

    info, model, optimizer, manager = build(args, ws, work / "hf-load-run")
    views, _ = own_state(model, optimizer, info.rank, ws)  # kept for the disk probe; the load builds anew

    def load(_r: int):
        loaded = AutoModelForCausalLM.from_pretrained(work / "hf-0", dtype=torch.float32)
        fresh = build_optimizer(loaded, manager.cfg.train)  # the same parameter groups as the saved one
        fresh.load_state_dict(torch.load(work / "hf-0" / "optimizer.pt", weights_only=True))

    return repeat(args, info.rank, work, views, load, work / "hf-0")


OPS = {"isotrain save": op_isotrain_save, "isotrain load": op_isotrain_load, "isotrain resume": op_isotrain_resume,
       "verify": op_verify,
       "dcp save": op_dcp_save, "dcp load": op_dcp_load, "hf save": op_hf_save, "hf load": op_hf_load}


def _worker(rank: int, ws: int, port: int, op: str, args, work: Path, kwargs: dict, out: Path) -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // ws))
    try:
        result = OPS[op](args, ws, work, **kwargs)
    except Exception as err:  # reported in the table, not fatal to the other rows
        result = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}",
                  "trace": traceback.format_exc()}
    result["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_op(op: str, ws: int, args, work: Path, **kwargs) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=work, prefix="result-"))
    try:
        mp.start_processes(_worker, args=(ws, free_port(), op, args, work, kwargs, out), nprocs=ws, join=True,
                           start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # a crash outside the operation
        return [{"error": f"process failed: {str(err).splitlines()[-1][:100]}", "rank": r} for r in range(ws)]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ws)]
    shutil.rmtree(out)
    for probe in work.glob("probe-*"):
        probe.unlink()
    os.sync()  # the probes' blocks are discarded now, not during the next row's timing
    return results


# ----- the table -----------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    ranks: str
    results: list[dict]
    num_bytes: int
    direction: str  # "write" or "read"

    @property
    def error(self) -> str | None:
        return next((r["error"] for r in self.results if "error" in r), None)

    def disk(self, key: str | None = None) -> list[float]:
        """GB/s of each disk probe: all ranks' bytes over the slowest rank's time."""
        key = key or f"{self.direction}_s"
        probes = zip(*(r["probes"] for r in self.results))
        return [sum(p["bytes"] for p in ps) / max(p[key] for p in ps) / 1e9 for ps in probes]

    def seconds(self) -> list[float]:
        return [max(times) for times in zip(*(r["seconds"] for r in self.results))]

    def ratios(self) -> list[float]:
        """GB/s of each repeat over the mean of the disk probes just before and just after it."""
        disk = self.disk()
        return [self.num_bytes / s / 1e9 / ((disk[i] + disk[i + 1]) / 2) for i, s in enumerate(self.seconds())]

    def blocked(self) -> list[float] | None:
        if not self.results[0].get("blocked"):
            return None
        return [max(times) for times in zip(*(r["blocked"] for r in self.results))]


def per_rank(row: Row, key: str) -> str:
    return " / ".join(f"{r[key] / 1e9:.2f}" for r in sorted(row.results, key=lambda r: r["rank"]) if key in r)


def print_table(console: Console, rows: list[Row], args, loadavg: tuple) -> None:
    median = statistics.median
    ok = [row for row in rows if not row.error]
    state_gb = next((row.num_bytes / 1e9 for row in ok if row.name == "isotrain save (sync)"), 0.0)
    num_params = next((r["num_params"] for row in ok for r in row.results if "num_params" in r), 0)
    writes = [d for row in ok if row.direction == "write" for d in row.disk()]
    ways = {way: [d for row in ok if row.direction == "write" for d in row.disk(f"{way}_write_s")]
            for way in ("buffered", "direct")}
    reads = [d for row in ok if row.direction == "read" for d in row.disk()]
    table = Table(title=f"checkpoints: Llama hidden {args.hidden}, {args.layers} layers, {num_params / 1e6:.1f}M "
                        f"parameters + AdamW = {state_gb:.2f} GB; disk (median of all probes): write+fsync "
                        f"{median(writes or [0]):.2f} GB/s (through the page cache "
                        f"{median(ways['buffered'] or [0]):.2f}, direct I/O {median(ways['direct'] or [0]):.2f}), "
                        f"cold read {median(reads or [0]):.2f} GB/s; "
                        f"median of {args.repeats}; load average {loadavg[0]:.2f} before, {loadavg[1]:.2f} after")
    for column in ("operation", "ranks", "s", "GB", "GB/s", "disk GB/s", "x disk", "blocked s 1st / later",
                   "peak RSS GB / rank", "extra GB / rank", "bound GB / rank"):
        table.add_column(column, justify="left" if column in ("operation", "ranks") else "right")
    sync_seconds, verdicts = {}, []
    for row in rows:
        if row.error:
            table.add_row(row.name, row.ranks, f"[red]failed: {escape(row.error)}[/]", *[""] * 8)
            continue
        seconds, ratio, blocked = median(row.seconds()), median(row.ratios()), row.blocked()
        blocked_text = "" if blocked is None else f"{blocked[0]:.2f} / {median(blocked[1:] or blocked):.2f}"
        table.add_row(row.name, row.ranks, f"{seconds:.2f}", f"{row.num_bytes / 1e9:.2f}",
                      f"{row.num_bytes / seconds / 1e9:.2f}", f"{median(row.disk()):.2f}", f"{ratio:.2f}",
                      blocked_text, per_rank(row, "peak"), per_rank(row, "extra"), per_rank(row, "bound"))
        verdicts += row_verdicts(row, ratio, blocked, sync_seconds)
    console.print(table)
    console.print("targets:")
    for name, met in verdicts:
        console.print(f"  {'[green]met[/]' if met else '[red]missed[/]'}  {escape(name)}")


def row_verdicts(row: Row, ratio: float, blocked: list[float] | None, sync_seconds: dict) -> list[tuple[str, bool]]:
    median, verdicts = statistics.median, []
    if row.name == "isotrain save (sync)":
        sync_seconds[row.ranks] = median(row.seconds())
        verdicts.append((f"sync save >= {TARGET_SAVE} x disk write [{row.ranks}]: {ratio:.2f}", ratio >= TARGET_SAVE))
    if row.name == "isotrain save (async)" and row.ranks in sync_seconds:
        for which, value in (("first save", blocked[0]), ("later saves", median(blocked[1:] or blocked))):
            share = value / sync_seconds[row.ranks]
            verdicts.append((f"async blocked <= {TARGET_BLOCKED:.0%} of the sync save [{row.ranks}, {which}]: "
                             f"{share:.0%}", share <= TARGET_BLOCKED))
    if row.name.startswith("isotrain resume"):
        verdicts.append((f"resume >= {TARGET_LOAD} x disk read [{row.ranks}]: {ratio:.2f}", ratio >= TARGET_LOAD))
    if all("bound" in r for r in row.results) and row.name.startswith("isotrain"):
        verdicts.append((f"extra memory <= bound [{row.name}, {row.ranks}]: {per_rank(row, 'extra')} <= "
                         f"{per_rank(row, 'bound')} GB", all(r["extra"] <= r["bound"] for r in row.results)))
    return verdicts


# ----- the run -------------------------------------------------------------------------------
PLAN = [  # (operation, ranks shown, op, world size, path measured, direction, kwargs); `ckpt-*` are kept
    ("isotrain save (sync)", "1", "isotrain save", 1, "run/checkpoints/step-00000001", "write", {"async_save": False}),
    ("isotrain save (sync)", "2 FSDP2", "isotrain save", 2, "run/checkpoints/step-00000001", "write",
     {"async_save": False}),
    ("isotrain save (async)", "1", "isotrain save", 1, "run/checkpoints/step-00000001", "write", {"async_save": True}),
    ("isotrain save (async)", "2 FSDP2", "isotrain save", 2, "run/checkpoints/step-00000001", "write",
     {"async_save": True}),
    ("isotrain load", "1 <- 1", "isotrain load", 1, "ckpt-ws1", "read", {"source": "ckpt-ws1"}),
    ("isotrain load", "2 <- 2", "isotrain load", 2, "ckpt-ws2", "read", {"source": "ckpt-ws2"}),
    ("isotrain load", "1 <- 2", "isotrain load", 1, "ckpt-ws2", "read", {"source": "ckpt-ws2"}),
    ("isotrain load", "2 <- 1", "isotrain load", 2, "ckpt-ws1", "read", {"source": "ckpt-ws1"}),
    ("isotrain resume (load + BLAKE3 check)", "1 <- 1", "isotrain resume", 1, "ckpt-ws1", "read",
     {"source": "ckpt-ws1"}),
    ("isotrain resume (load + BLAKE3 check)", "2 <- 2", "isotrain resume", 2, "ckpt-ws2", "read",
     {"source": "ckpt-ws2"}),
    ("isotrain resume (load + BLAKE3 check)", "1 <- 2", "isotrain resume", 1, "ckpt-ws2", "read",
     {"source": "ckpt-ws2"}),
    ("isotrain resume (load + BLAKE3 check)", "2 <- 1", "isotrain resume", 2, "ckpt-ws1", "read",
     {"source": "ckpt-ws1"}),
    ("isotrain ckpt verify (BLAKE3)", "1", "verify", 1, "ckpt-ws2", "read", {"source": "ckpt-ws2"}),
    ("DCP save", "1", "dcp save", 1, "dcp-fs/ws1-0", "write", {"writer": "fs"}),
    ("DCP save", "2 FSDP2", "dcp save", 2, "dcp-fs/ws2-0", "write", {"writer": "fs"}),
    ("DCP async_save", "2 FSDP2", "dcp save", 2, "dcp-async/ws2-0", "write", {"writer": "async"}),
    ("DCP HF writer (model only)", "1", "dcp save", 1, "dcp-hf/ws1-0", "write", {"writer": "hf"}),
    ("DCP HF writer, consolidated (model only)", "2 FSDP2", "dcp save", 2, "dcp-hf/ws2-0", "write", {"writer": "hf"}),
    ("DCP load", "2 <- 2", "dcp load", 2, "dcp-fs/ws2-0", "read", {"source": "dcp-fs/ws2-0"}),
    ("DCP load", "1 <- 2", "dcp load", 1, "dcp-fs/ws2-0", "read", {"source": "dcp-fs/ws2-0"}),
    ("save_pretrained + torch.save", "1", "hf save", 1, "hf-0", "write", {}),
    ("from_pretrained + torch.load", "1", "hf load", 1, "hf-0", "read", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768, help="Llama hidden size (heads = hidden / 64)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=1664)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3, help="times each operation runs (medians are shown)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, split over ranks")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (one disk)")
    parser.add_argument("--skip-dcp", action="store_true", help="skip the DCP rows")
    parser.add_argument("--skip-hf", action="store_true", help="skip the save_pretrained / from_pretrained rows")
    parser.add_argument("--only", default="", help="run only the rows whose operation contains this text (loads "
                                                    "also need the 'isotrain save (sync)' rows, which write what they read)")
    args = parser.parse_args()
    console = Console(width=None if os.isatty(1) else 220)
    work = Path(tempfile.mkdtemp(prefix="isotrain-ckpt-bench-", dir=args.dir))
    rows: list[Row] = []
    loadavg_before = os.getloadavg()[0]
    try:
        for name, ranks, op, ws, measured, direction, kwargs in PLAN:
            if (args.skip_dcp and op.startswith("dcp")) or (args.skip_hf and op.startswith("hf")) or (
                    args.only not in name):
                continue
            results = run_op(op, ws, args, work, **kwargs)
            num_bytes = tree_bytes(work / measured) if (work / measured).exists() else 0
            rows.append(row := Row(name, ranks, results, num_bytes, direction))
            if op == "isotrain save" and not kwargs["async_save"] and not row.error:
                shutil.move(work / measured, work / f"ckpt-ws{ws}")  # what the loads read
            shutil.rmtree(work / "run", ignore_errors=True)
            for scratch in ("dcp-async", "dcp-hf"):
                shutil.rmtree(work / scratch, ignore_errors=True)
            state = f"[red]failed: {escape(row.error)}[/]" if row.error else f"{statistics.median(row.seconds()):.2f} s"
            console.print(f"{name} [{ranks}]: {state}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(console, rows, args, (loadavg_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
