"""bench/parallel.py's long-sequence and pipeline rows: context-parallel memory per rank next to the estimate, and
the pipeline's bubble next to the schedule's theory. Each row group is one `torchrun --standalone` launch per degree
of this file's workers (`--cp-worker`, `--pp-worker`, through bench/parallel.py), on gloo, fp32, AdamW.

Context parallel (`--cp-memory`): a tiny Llama (vocab 8192, hidden 128, 2 layers, 4 heads = 4 KV heads), one
sequence of L tokens per step, L in --cp-lengths (1k, 2k, 4k, 8k), CP 1, 2 and 4 with Ulysses and ring. After a
warm-up step (so the AdamW moments exist), each rank runs one `train_step` per L; its peak is VmHWM during the step
minus VmRSS before it (free heap returned first), which holds what the step itself allocates: gradients,
activations, logits, the exchanges' buffers, allocator slack. Next to it the estimate of the same step
(`isotrain estimate-memory` of that config: gradients + activations + compute copies + logits and loss + exchange
buffers; parameters and moments exist before the step) and its total per rank.

Pipeline (`--pipeline`): a Llama (vocab 8192, hidden 256, 8 layers, seq 256, micro-batch 1) on PP 2 and PP 4 with
m micro-batches per step (--pp-microbatches, default 4 and 8), 1F1B and GPipe. Step time: the median over
--pp-steps steps of the slowest rank, after a warm-up step that builds the schedule. Bubble: each rank's compute is
the time inside torch's forward_one_chunk and backward_one_chunk (a stage's forward, its loss, its backward); the
measured bubble of a step is 1 - (mean compute over the ranks) / (the schedule's time: the slowest rank's time in
isotrain's Pipeline.backward, which runs every micro-batch through the stages; the step's counts, gradient sums,
norm and update are outside it), next to (p - 1) / (m + p - 1), the
idle share of an ideal 1F1B or GPipe schedule whose stages take equal time. PP 4 puts 4 processes on 2 cores: a
rank waiting for its neighbour lends its core to another, so the measured bubble there is the layout's cost on this
machine, not on 4 devices (the table marks it); the first and last stage also differ (embedding, head and loss).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from checkpoint import rss_bytes  # bench/ is the script's folder, so on sys.path

VOCAB = 8192
CP_MODEL = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 352,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}
PP_MODEL = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 688,
            "max_position_embeddings": 256, "tie_word_embeddings": False}
PP_SEQ = 256
CP_LAUNCHES = [(1, "ulysses"), (2, "ulysses"), (4, "ulysses"), (2, "ring"), (4, "ring")]
STEP_TERMS = ("gradients", "activations", "compute copies", "logits and loss", "context-parallel exchange buffers")


def _config(model: dict, seq: int, global_batch: int, micro_batch: int, parallel: dict):
    from isotrain.config import build_config

    return build_config({"model": {"config": model}, "data": {"max_seq_len": seq},
                         "train": {"global_batch_size": global_batch, "micro_batch_size": micro_batch, "seed": 0,
                                   "lr": 3e-4, "schedule": "constant", "grad_clip": 1.0},
                         "parallel": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, **parallel}})


def _micro_batch(seq: int, seed: int) -> dict:
    import torch

    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).expand(1, seq).clone(),
            "segment_ids": torch.zeros(1, seq, dtype=torch.long), "num_input_tokens": seq, "num_trained_tokens": seq}


def _build(cfg, info):
    from isotrain.models.build import build
    from isotrain.models.tokenizer import train_tokenizer
    from isotrain.parallel.dims import resolve_dims
    from isotrain.parallel.mesh import build_parallel
    from isotrain.train.optim import build_optimizer
    from isotrain.train.setup import step_options

    tokenizer = train_tokenizer(["abcdefghijklmnopqrstuvwxyz"], "char", 0)
    parallel = build_parallel(resolve_dims(cfg.parallel, info.world_size), info.device, info.rank)
    model = build(cfg.model, tokenizer, 0, parallel, info.device, loss_parallel=True)
    return model, build_optimizer(model, cfg.train), step_options(cfg, parallel), parallel


def _gather(info, row) -> list:
    import torch.distributed as dist

    rows = [row]
    if dist.is_initialized():
        rows = [None] * info.world_size
        dist.all_gather_object(rows, row)
    return rows


def run_cp_worker(cp: int, style: str, lengths: list[int], out: str) -> None:
    import torch

    from isotrain.parallel.dist import init_distributed, shutdown_distributed
    from isotrain.train.step import train_step
    from parallel import fresh_memory_window

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    info = init_distributed()
    cfg = _config(CP_MODEL, max(lengths), 1, 1, {"cp": cp, "cp_style": style})
    model, optimizer, options, _ = _build(cfg, info)
    train_step(model, optimizer, [_micro_batch(512, 0)], 3e-4, options, info.device)  # the moments exist now
    peaks = {}
    for length in lengths:
        base = fresh_memory_window()
        start = time.perf_counter()
        train_step(model, optimizer, [_micro_batch(length, length)], 3e-4, options, info.device)
        peaks[length] = {"peak_bytes": rss_bytes("VmHWM") - base, "step_s": time.perf_counter() - start}
    rows = _gather(info, {"rank": info.rank, "peaks": peaks})
    if info.is_main:
        Path(out).write_text(json.dumps({"cp": cp, "style": style, "ranks": rows}))
    shutdown_distributed()


def _timed(original, seconds: list, index: int):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[index] += time.perf_counter() - start
    return run


def _timed_schedule(seconds: list) -> None:
    """Add the time of every forward_one_chunk and backward_one_chunk of torch's stages to `seconds[0]`, and the
    time of the whole schedule (isotrain's Pipeline.backward: every micro-batch's forward and backward with their
    sends and receives; not the step's counts, gradient sums, norm and update) to `seconds[1]`."""
    from torch.distributed.pipelining import PipelineStage

    from isotrain.parallel.pp import Pipeline

    PipelineStage.forward_one_chunk = _timed(PipelineStage.forward_one_chunk, seconds, 0)
    PipelineStage.backward_one_chunk = _timed(PipelineStage.backward_one_chunk, seconds, 0)
    Pipeline.backward = _timed(Pipeline.backward, seconds, 1)


def run_pp_worker(pp: int, microbatches: list[int], steps: int, out: str) -> None:
    import dataclasses

    import torch

    from isotrain.parallel.dist import barrier, init_distributed, shutdown_distributed
    from isotrain.parallel.pp import Pipeline
    from isotrain.train.step import train_step

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    info = init_distributed()
    cfg = _config(PP_MODEL, PP_SEQ, max(microbatches), 1, {"pp": pp})
    model, optimizer, options, parallel = _build(cfg, info)
    busy = [0.0, 0.0]  # (compute in torch's stage, the schedule) of a step
    _timed_schedule(busy)
    results = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (m for m in microbatches if m >= pp):  # torch's single-stage schedules need m >= stages
            pipeline = Pipeline(parallel.pp_rank, pp, parallel.pp_group, schedule)
            run = dataclasses.replace(options, pipeline=pipeline)
            batches = [_micro_batch(PP_SEQ, 1000 * m + i) for i in range(m)]
            train_step(model, optimizer, batches, 3e-4, run, info.device)  # builds the schedule (shape inference)
            times = []
            for _ in range(steps):
                barrier()
                busy[:] = [0.0, 0.0]
                start = time.perf_counter()
                train_step(model, optimizer, batches, 3e-4, run, info.device)
                times.append((time.perf_counter() - start, *busy))
            results[f"{schedule} {m}"] = times
    rows = _gather(info, {"rank": info.rank, "results": results})
    if info.is_main:
        Path(out).write_text(json.dumps({"pp": pp, "ranks": rows}))
    shutdown_distributed()


# ----- the parent's side: estimates and tables ------------------------------------------------
def cp_estimates(cp: int, style: str, length: int) -> tuple[int, int]:
    """(the estimate's bytes of what one step allocates, its total) per rank."""
    from isotrain.memory.estimate import estimate_memory

    cfg = _config(CP_MODEL, length, 1, 1, {"cp": cp, "cp_style": style})
    estimate = estimate_memory(cfg, cp, vocab_size=VOCAB, device="cpu")
    step = sum(t.bytes for t in estimate.terms if t.name in STEP_TERMS)
    return step, estimate.total_bytes


def cp_table(results: list[dict], lengths: list[int], load: str):
    from rich.table import Table

    table = Table(title=f"context parallel: peak memory per rank of one SFT step, Llama vocab {VOCAB}, hidden 128, "
                        f"2 layers, 4 heads, 1 sequence per step, fp32, AdamW; worst rank; {load}; MiB = 2^20 bytes")
    for column in ("CP", "style", "tokens", "tokens / rank", "measured step peak MiB", "estimated step MiB",
                   "measured / estimated", "estimated total MiB", "step s"):
        table.add_column(column, justify="right")
    mib = 1 / 2**20
    for result in results:
        if "error" in result:
            table.add_row(str(result["cp"]), result["style"], "", "", f"failed: {result['error']}", *[""] * 4)
            continue
        for length in lengths:
            peak = max(r["peaks"][str(length)]["peak_bytes"] for r in result["ranks"])
            step_s = max(r["peaks"][str(length)]["step_s"] for r in result["ranks"])
            step, total = cp_estimates(result["cp"], result["style"], length)
            table.add_row(str(result["cp"]), result["style"] if result["cp"] > 1 else "-", f"{length:,}",
                          f"{length // result['cp']:,}", f"{peak * mib:,.1f}", f"{step * mib:,.1f}",
                          f"{peak / step:.2f}", f"{total * mib:,.1f}", f"{step_s:.2f}")
    return table


def pp_table(results: list[dict], load: str, cores: int):
    from rich.table import Table

    table = Table(title=f"pipeline: step time and bubble, Llama vocab {VOCAB}, hidden 256, 8 layers, seq {PP_SEQ}, "
                        f"micro-batch 1, fp32, AdamW; slowest rank, median step; {load}")
    for column in ("PP", "schedule", "micro-batches m", "step s", "tokens/s", "measured bubble",
                   "theory (p-1)/(m+p-1)", "note"):
        table.add_column(column, justify="right")
    for result in results:
        pp = result["pp"]
        if "error" in result:
            table.add_row(str(pp), "", "", f"failed: {result['error']}", *[""] * 4)
            continue
        for key in result["ranks"][0]["results"]:
            schedule, m = key.split()
            m = int(m)
            # per step, per rank: (step s, compute s, schedule s)
            per_step = list(zip(*(r["results"][key] for r in result["ranks"])))
            step_s = statistics.median(max(r[0] for r in ranks) for ranks in per_step)
            bubble = statistics.median(1 - statistics.mean(r[1] for r in ranks) / max(r[2] for r in ranks)
                                       for ranks in per_step)
            note = f"oversubscribed: {pp} processes on {cores} cores" if pp > cores else ""
            table.add_row(str(pp), schedule, str(m), f"{step_s:.3f}", f"{m * PP_SEQ / step_s:,.0f}",
                          f"{bubble:.2f}", f"{(pp - 1) / (m + pp - 1):.2f}", note)
    return table
