"""Parallel layouts side by side: throughput, start-up time and memory per rank, one model, one global batch.

Layouts (dp_replicate × dp_shard × tp): 1 process (1×1×1), DDP 2 (2×1×1), FSDP2 2 (1×2×1), TP 2 (1×1×2) and
FSDP2 × TP 2 × 2 (1×2×2, 4 processes).

MoE rows (a Qwen3-MoE of the same sizes, --experts experts (default 8), top-2, every layer sparse, expert
width = hidden): 1 process, EP 2 (parallel.ep=2 over 2 DP ranks: each holds half the experts, tokens travel
by all-to-all), EP 2 × FSDP2 2 (dp_shard 2 on 2 processes: dense parameters sharded, experts EP-sharded over
the same ranks), TP 2 (attention split, router and experts replicated over TP), EP 2 × TP 2 (4 processes:
experts split over EP, replicated over TP), and "HF step": the same model and weights trained in one process by transformers' own
code path (its loss from `labels`, torch's AdamW and clip_grad_norm_, no isotrain step), for reference. Each layout is a fresh `torchrun --standalone` launch of this script
(`--worker LAYOUT`) on gloo; its ranks build a fresh Llama with the trainer's own `prepare_model`
(`isotrain.models.build.build`: built on the meta device, parallelised, each rank materialises and
initialises only its shards; then isotrain's AdamW), seed 0: vocab 8192, hidden --hidden (default 512),
--layers (default 4) layers, heads = max(hidden / 64, 4) (as many KV heads), MLP width ≈ 8/3 × hidden
rounded up to a multiple of 16, untied embeddings, fp32. Every layout trains on the same global batches: --global-batch
(default 8) generated sequences of exactly 256 random token ids (no padding), ordered by isotrain's
GlobalBatchSampler (seed 0) and cut by DP rank into one micro-batch each (GA 1: micro-batch = global batch
/ DP size; TP ranks share their data), collated by isotrain's `collate`, trained by isotrain's `train_step`
(token-mean loss, grad clip 1.0, constant lr 3e-4). The loss of every step is compared with the 1-process
run's: the same global batches give the same loss (to fp32 rounding) on every layout.

Measured per rank, then shown as the worst rank (max; tokens/s from the slowest rank's step times):

    start-up s       wall time of `prepare_model` (build + optimizer), from a barrier; a 1-layer, hidden-64
                     model of the same layout is built first, untimed, so one-time imports and caches are
                     outside it. The AdamW moments do not exist yet: torch creates them at the first step.
    start-up peak    VmHWM after start-up minus VmRSS before it (VmHWM reset by writing 5 to
                     /proc/self/clear_refs, free heap pages returned with malloc_trim first): the memory
                     start-up needs on top of the process's base. "own + largest" is the bound that
                     models/build.py promises: this rank's parameter bytes plus the largest full tensor
                     (a fresh initialisation draws each module's full tensors into scratch memory, one
                     module at a time). DDP adds its gradient buckets, allocated when the model is
                     wrapped: about one more copy of the model
    train peak       VmHWM over warm-up + timed steps (reset after start-up), absolute: the process's
                     base (interpreter, torch, transformers: the "base" column) is included
    tokens/s         global non-padding input tokens of a step / that step's time, median over the timed
                     steps. A step's time is the slowest rank's `train_step` (forward, backward, gradient
                     sums, clipping, AdamW), started from a barrier; collating the batch is outside it
    model MB         the full model's fp32 parameter bytes (what one process holds)

Threads: OMP_NUM_THREADS (and torch.set_num_threads) make the total equal the machine's 2 cores: 2 threads
for 1 process, 1 per rank otherwise. 4 processes on 2 cores are oversubscribed (two ranks per core, taking
turns at every collective), so the FSDP2 × TP row measures the layout's cost on this machine, not its
speed on 4 devices; the table marks it. Nothing is saved: no checkpoint, no metrics file.

Only a quiet machine gives ratios worth keeping (the table's title shows the load average during the
runs). Under load the layouts are not compared fairly: 4 processes get a larger share of the CPUs than
1, and the 2 OpenMP threads of one process wait for each other at every parallel region (at load ≈ 5,
one process ran 1.8 × slower on 2 threads than on 1; one process on 2 threads made 113 tokens/s at
load 7 and 1200 at load 3 on the same machine, minutes apart).

    python bench/parallel.py [--steps 10] [--warmup 2] [--hidden 512] [--layers 4] [--global-batch 8]
                             [--layouts single ddp2 fsdp2 tp2 fsdp2xtp2 moe_single moe_ep2 moe_ep2xfsdp2 moe_tp2
                                        moe_ep2xtp2 moe_hf]
                             [--experts 8] [--json results.json]
    python bench/parallel.py --hidden 64 --layers 2 --steps 2 --warmup 1   # quick check, a minute or two
    python bench/parallel.py --cp-memory [--cp-lengths 1024 2048 4096 8192] --pipeline [--pp-microbatches 4 8]
                                                    # only the context-parallel memory and pipeline rows
                                                    # (bench/parallel_rows.py says what they measure)

Run from a checkout with PYTHONPATH=. (the workers import the isotrain that this script imports; the script's
folder, not the current one, comes first on sys.path, so an installed isotrain would be measured otherwise).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import parallel_rows
from checkpoint import reset_peak_rss, rss_bytes  # bench/ is the script's folder, so on sys.path

CORES = 2
SEQ_LEN = 256
VOCAB = 8192
SEED, LR = 0, 3e-4
LOSS_RTOL = 1e-4  # fp32: TP and sharding reorder sums; a wrong batch would differ in the first digits
LAYOUTS = {  # key: (label, (dp_replicate, dp_shard, tp))
    "single": ("1 process", (1, 1, 1)),
    "ddp2": ("DDP 2", (2, 1, 1)),
    "fsdp2": ("FSDP2 2", (1, 2, 1)),
    "tp2": ("TP 2", (1, 1, 2)),
    "fsdp2xtp2": ("FSDP2 × TP 2 × 2", (1, 2, 2)),
    # MoE: (dp_replicate, dp_shard, tp, ep)
    "moe_single": ("MoE 1 process", (1, 1, 1, 1)),
    "moe_ep2": ("MoE EP 2", (2, 1, 1, 2)),
    "moe_ep2xfsdp2": ("MoE EP 2 × FSDP2 2", (1, 2, 1, 2)),
    "moe_tp2": ("MoE TP 2", (1, 1, 2, 1)),  # experts replicated over TP
    "moe_ep2xtp2": ("MoE EP 2 × TP 2", (2, 1, 2, 2)),  # 4 processes
    "moe_hf": ("MoE HF step, 1 process", (1, 1, 1, 1)),
}


def is_moe(key: str) -> bool:
    return key.startswith("moe_")


def num_processes(key: str) -> int:
    return math.prod(LAYOUTS[key][1][:3])  # ep takes no ranks of its own


# ----- memory -------------------------------------------------------------------------------
def release_free_heap() -> None:
    """Give malloc's free pages back to the system, so that start-up cannot reuse memory that an earlier
    allocation left resident (its peak would then look smaller than its allocations)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measurement is merely less strict
        pass


def fresh_memory_window() -> int:
    """Start a peak measurement on every rank together: garbage collected, free pages given back, the ranks lined up,
    the peak reset; returns the resident bytes now, from which the window's peak (VmHWM) counts."""
    from isotrain.parallel.dist import barrier

    gc.collect()
    release_free_heap()
    barrier()
    base = rss_bytes("VmRSS")
    reset_peak_rss()
    return base


# ----- the worker (one rank of one layout, under torchrun) ----------------------------------
def llama(hidden: int, layers: int) -> dict:
    heads = max(hidden // 64, 4)  # at least 4, so that TP 2 splits the heads of small test models too
    return {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "intermediate_size": 16 * math.ceil(8 * hidden / 3 / 16), "max_position_embeddings": SEQ_LEN,
        "tie_word_embeddings": False,
    }


def qwen3_moe(hidden: int, layers: int, experts: int) -> dict:
    heads = max(hidden // 64, 4)
    return {
        "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
        "intermediate_size": 16 * math.ceil(8 * hidden / 3 / 16), "moe_intermediate_size": hidden,
        "num_experts": experts, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": SEQ_LEN, "tie_word_embeddings": False,
    }


def bench_config(hidden: int, layers: int, global_batch: int, micro_batch: int, experts: int = 0):
    from isotrain.config import build_config

    return build_config({
        "model": {"config": qwen3_moe(hidden, layers, experts) if experts else llama(hidden, layers)},
        "train": {"global_batch_size": global_batch, "micro_batch_size": micro_batch, "seed": SEED, "lr": LR,
                  "schedule": "constant", "grad_clip": 1.0},
    })


def make_samples(num_samples: int, first_id: int) -> list:
    """Sequences of SEQ_LEN random ids in [first_id, VOCAB): one document each, every token but the last trained."""
    from isotrain.data.packing import Sample

    rng = np.random.default_rng(SEED)
    samples = []
    for i in range(num_samples):
        ids = rng.integers(first_id, VOCAB, size=SEQ_LEN, dtype=np.int64)
        labels = np.concatenate([ids[1:], [-100]])  # pre-shifted, as isotrain's tokenization stores them
        samples.append(Sample(ids, labels, np.arange(SEQ_LEN, dtype=np.int64), np.zeros(SEQ_LEN, dtype=np.int64),
                              (i,)))
    return samples


def parameter_bytes(model) -> tuple[int, int, int]:
    """(this rank's parameter bytes, the full model's, the largest full tensor's)."""
    from torch.distributed.tensor import DTensor

    own = full = largest = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        size = param.numel() * param.element_size()  # a DTensor's numel is the global one
        own += local.numel() * local.element_size()
        full += size
        largest = max(largest, size)
    return own, full, largest


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from isotrain.data.collate import collate
    from isotrain.data.sampler import GlobalBatchSampler
    from isotrain.models.tokenizer import train_tokenizer
    from isotrain.parallel.dims import ParallelDims
    from isotrain.parallel.dist import barrier, init_distributed, shutdown_distributed
    from isotrain.parallel.mesh import build_parallel
    from isotrain.parallel.tp import check_replicated
    from isotrain.train.setup import prepare_model
    from isotrain.train.setup import step_options
    from isotrain.train.step import train_step

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    info = init_distributed()
    dims = ParallelDims(*LAYOUTS[args.worker][1])
    experts = args.experts if is_moe(args.worker) else 0
    if dims.world_size != info.world_size:
        raise SystemExit(f"layout {args.worker} needs {dims.world_size} processes, got {info.world_size}")
    parallel = build_parallel(dims, info.device, info.rank)
    micro_batch = args.global_batch // dims.dp_size  # GA 1
    cfg = bench_config(args.hidden, args.layers, args.global_batch, micro_batch, experts)
    tokenizer = train_tokenizer(["abcdefghijklmnopqrstuvwxyz"], "char", 0)
    samples = make_samples(args.global_batch * (args.warmup + args.steps), first_id=len(tokenizer))

    # Untimed: the same path on a tiny model, so lazy imports and first-call caches are not start-up cost.
    warm_model, warm_optimizer = prepare_model(bench_config(64, 1, args.global_batch, micro_batch, experts and 4),
                                               info, tokenizer, parallel)
    del warm_model, warm_optimizer
    base_rss = fresh_memory_window()
    start = time.perf_counter()
    model, optimizer = prepare_model(cfg, info, tokenizer, parallel)
    if args.worker == "moe_hf":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=cfg.train.weight_decay)
    startup_s = time.perf_counter() - start
    if dims.ep > 1:  # an isotrain without expert parallelism (e.g. another install on the path) would run plain DP
        from isotrain.parallel.ep import expert_parameters

        if not expert_parameters(model):
            raise SystemExit(f"layout {args.worker}: the model's experts are not expert-parallel")
    startup_peak = rss_bytes("VmHWM") - base_rss
    own_bytes, model_bytes, largest_bytes = parameter_bytes(model)

    barrier()
    reset_peak_rss()
    sampler = GlobalBatchSampler(len(samples), args.global_batch, SEED)
    options = step_options(cfg, parallel)
    step_s, tokens, losses = [], [], []
    for step in range(args.warmup + args.steps):
        indices = sampler.micro_batches(step, parallel.dp_rank, dims.dp_size, micro_batch)
        micro_batches = [collate([samples[i] for i in index], tokenizer.pad_token_id) for index in indices]
        barrier()
        start = time.perf_counter()
        if args.worker == "moe_hf":
            loss, num_tokens = hf_step(model, optimizer, micro_batches[0])
        else:
            result = train_step(model, optimizer, micro_batches, LR, options, info.device)
            loss, num_tokens = result.loss, result.num_input_tokens  # global: summed over the DP group
        step_s.append(time.perf_counter() - start)
        tokens.append(num_tokens)
        losses.append(loss)
        if step == 0:  # as the trainer does: TP replicas that drifted apart would make the numbers meaningless
            check_replicated(model, parallel.tp_group)
    rank = {"rank": info.rank, "startup_s": startup_s, "base_rss_bytes": base_rss, "startup_peak_bytes": startup_peak,
            "train_peak_bytes": rss_bytes("VmHWM"), "own_param_bytes": own_bytes, "step_s": step_s}
    ranks = [rank]
    if dist.is_initialized():
        ranks = [None] * info.world_size
        dist.all_gather_object(ranks, rank)
    if info.is_main:
        Path(args.out).write_text(json.dumps({
            "layout": args.worker, "degrees": list(LAYOUTS[args.worker][1]), "world_size": info.world_size,
            "threads_per_rank": torch.get_num_threads(), "micro_batch": micro_batch, "model_bytes": model_bytes,
            "largest_tensor_bytes": largest_bytes, "tokens": tokens, "losses": losses, "warmup": args.warmup,
            "ranks": ranks,
        }))
    shutdown_distributed()


def hf_step(model, optimizer, batch: dict) -> tuple[float, int]:
    """One step the way a plain transformers script takes it (1 process, 1 micro-batch): the model's own
    loss from `labels` (the batch's labels are pre-shifted, so they are shifted back by one position for
    transformers to shift them again), backward, clip_grad_norm_(1.0), AdamW."""
    import torch

    labels = torch.cat([torch.full_like(batch["labels"][:, :1], -100), batch["labels"][:, :-1]], dim=1)
    loss = model(input_ids=batch["input_ids"], labels=labels, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss), int(batch["num_input_tokens"])


# ----- the parent: one torchrun launch per layout, then the table -----------------------------
def launch(key: str, args, out: Path, log: Path) -> dict:
    """Run one layout under torchrun; its rank 0's JSON result, or {"error": ...}."""
    worker = ["--worker", key, "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
              "--layers", str(args.layers), "--global-batch", str(args.global_batch), "--experts", str(args.experts)]
    result = run_torchrun(num_processes(key), worker, out, log)
    return {"layout": key, **result} if "error" in result else result


def run_torchrun(nproc: int, worker: list[str], out: Path, log: Path) -> dict:
    """Run this script's worker (`worker`: its arguments) on `nproc` processes under torchrun; rank 0's JSON
    result with the launch's wall time and load average, or {"error": ..., "log_tail": ...}."""
    import isotrain

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(CORES // nproc, 1))
    # The workers import the same isotrain as this process, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(isotrain.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               __file__, *worker, "--out", str(out)]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall_s, load_after = time.perf_counter() - start, os.getloadavg()[0]
    if done.returncode != 0 or not out.exists():
        lines = log.read_text().strip().splitlines()
        # The exception each rank raised (torchrun's own summary after it does not name it).
        errors = list(dict.fromkeys(line.split("]: ", 1)[-1] for line in lines if "Error: " in line))
        tail = errors[-3:] or lines[-12:]
        return {"error": f"exit code {done.returncode}", "log_tail": tail}
    return {**json.loads(out.read_text()), "launch_wall_s": wall_s, "load_before": load_before,
            "load_after": load_after}


def summarise(result: dict) -> dict:
    """The table's numbers of one layout: worst rank for times and memory."""
    ranks = result["ranks"]
    warmup = result["warmup"]
    slowest = [max(times) for times in zip(*(r["step_s"] for r in ranks))][warmup:]
    rates = [tokens / seconds for tokens, seconds in zip(result["tokens"][warmup:], slowest)]
    mb = 1 / 2**20
    own = max(r["own_param_bytes"] for r in ranks)
    return {
        "tokens_per_s": statistics.median(rates),
        "startup_s": max(r["startup_s"] for r in ranks),
        "startup_peak_mb": max(r["startup_peak_bytes"] for r in ranks) * mb,
        "bound_mb": (own + result["largest_tensor_bytes"]) * mb,
        "train_peak_mb": max(r["train_peak_bytes"] for r in ranks) * mb,
        "base_mb": max(r["base_rss_bytes"] for r in ranks) * mb,
        "model_mb": result["model_bytes"] * mb,
    }


def loss_check(results: list[dict], moe: bool = False) -> str:
    """Every layout trained on the same global batches: its per-step losses must equal the 1-process run's
    (of the same model: Llama or MoE)."""
    single = "moe_single" if moe else "single"
    reference = next((r for r in results if r.get("layout") == single and "error" not in r), None)
    if reference is None:
        return f"losses not compared: the {LAYOUTS[single][0]} layout was not run"
    worst = 0.0
    for result in results:
        if "error" not in result and is_moe(result["layout"]) == moe:
            worst = max([worst, *(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"]))])
    verdict = "[green]same[/]" if worst <= LOSS_RTOL else "[red]DIFFERENT[/]"
    return (f"losses of every step vs {LAYOUTS[single][0]}: {verdict} (max relative difference {worst:.1e}, "
            f"tolerance {LOSS_RTOL:g})")


def print_table(console, results: list[dict], args) -> None:
    from rich.markup import escape
    from rich.table import Table

    done = [r for r in results if "error" not in r]
    loads = [x for r in done for x in (r["load_before"], r["load_after"])]
    model_mb = done[0]["model_bytes"] / 2**20 if done else 0.0
    moe = f" (MoE rows: Qwen3-MoE, {args.experts} experts, top-2)" if any(is_moe(r["layout"]) for r in results) else ""
    table = Table(title=f"parallel layouts: Llama{moe} vocab {VOCAB}, hidden {args.hidden}, {args.layers} layers "
                        f"({model_mb:.0f} MB fp32), seq {SEQ_LEN}, global batch {args.global_batch}, fp32, AdamW; "
                        f"{args.warmup} warm-up + {args.steps} timed steps; {CORES} cores, load average "
                        f"{min(loads or [0]):.1f}-{max(loads or [0]):.1f} during the runs; MB = 2^20 bytes, worst rank")
    for column in ("layout", "processes", "threads / rank", "micro-batch × GA", "tokens/s", "x 1 process",
                   "start-up s", "start-up peak MB / rank", "own + largest MB", "train peak MB / rank", "base MB",
                   "model MB"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    singles = {is_moe(r["layout"]): summarise(r)["tokens_per_s"] for r in done if r["layout"] in ("single", "moe_single")}
    for result in results:
        single = singles.get(is_moe(result["layout"]))
        label = LAYOUTS[result["layout"]][0]
        if "error" in result:
            table.add_row(label, "", "", "", f"[red]failed: {escape(result['error'])}[/]", *[""] * 7)
            continue
        s = summarise(result)
        nproc = str(result["world_size"])
        threads = result["world_size"] * result["threads_per_rank"]
        if threads > CORES:
            nproc += f" [yellow](oversubscribed: {threads} threads on {CORES} cores)[/]"
        ratio = f"{s['tokens_per_s'] / single:.2f}" if single else "-"
        table.add_row(label, nproc, str(result["threads_per_rank"]), f"{result['micro_batch']} × 1",
                      f"{s['tokens_per_s']:.0f}", ratio, f"{s['startup_s']:.2f}", f"{s['startup_peak_mb']:.0f}",
                      f"{s['bound_mb']:.0f}", f"{s['train_peak_mb']:.0f}", f"{s['base_mb']:.0f}",
                      f"{s['model_mb']:.0f}")
    console.print(table)
    for moe in sorted({is_moe(r["layout"]) for r in results}):
        console.print(loss_check(results, moe))
    for result in results:
        if "error" in result:
            console.print(f"{LAYOUTS[result['layout']][0]} failed:")
            console.print(escape("\n".join(result["log_tail"])))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="Timed optimizer steps per layout.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed optimizer steps before them.")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="Layouts to run, in this order.")
    parser.add_argument("--hidden", type=int, default=512,
                        help="Llama hidden size, a multiple of 4 (heads = max(hidden / 64, 4)).")
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers.")
    parser.add_argument("--global-batch", type=int, default=8, help="Sequences per optimizer step (divisible by 2).")
    parser.add_argument("--experts", type=int, default=8, help="Experts of the MoE rows' model (top-2).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the raw per-rank numbers here.")
    parser.add_argument("--cp-memory", action="store_true",
                        help="Run the context-parallel memory rows (only these and --pipeline unless --layouts is "
                        "given).")
    parser.add_argument("--cp-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="Sequence lengths of the context-parallel rows.")
    parser.add_argument("--pipeline", action="store_true",
                        help="Run the pipeline rows (only these and --cp-memory unless --layouts is given).")
    parser.add_argument("--pp-microbatches", type=int, nargs="+", default=[4, 8], help="Micro-batches per step.")
    parser.add_argument("--pp-steps", type=int, default=5, help="Timed steps of each pipeline row.")
    parser.add_argument("--worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--cp-worker", nargs=2, help=argparse.SUPPRESS)  # CP STYLE
    parser.add_argument("--pp-worker", type=int, help=argparse.SUPPRESS)  # PP
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layouts_given = any(a == "--layouts" for a in sys.argv)
    return args


def run_sections(console, args, tmp: Path) -> None:
    """The context-parallel memory rows and the pipeline rows (bench/parallel_rows.py), each degree one launch."""
    loads = []
    if args.cp_memory:
        results = []
        for cp, style in parallel_rows.CP_LAUNCHES:
            worker = ["--cp-worker", str(cp), style, "--cp-lengths", *map(str, args.cp_lengths)]
            result = run_torchrun(cp, worker, tmp / f"cp{cp}{style}.json", tmp / f"cp{cp}{style}.log")
            results.append({"cp": cp, "style": style, **result})
            loads += [result.get("load_before", 0), result.get("load_after", 0)]
            console.print(f"CP {cp} {style}: {result.get('error', 'done')} ({result.get('launch_wall_s', 0):.0f} s)")
        load = f"{CORES} cores, load average {min(loads):.1f}-{max(loads):.1f}"
        console.print(parallel_rows.cp_table(results, args.cp_lengths, load))
    if args.pipeline:
        results, loads = [], []
        for pp in (2, 4):
            worker = ["--pp-worker", str(pp), "--pp-microbatches", *map(str, args.pp_microbatches), "--pp-steps",
                      str(args.pp_steps)]
            result = run_torchrun(pp, worker, tmp / f"pp{pp}.json", tmp / f"pp{pp}.log")
            results.append({"pp": pp, **result})
            loads += [result.get("load_before", 0), result.get("load_after", 0)]
            console.print(f"PP {pp}: {result.get('error', 'done')} ({result.get('launch_wall_s', 0):.0f} s)")
        load = f"{CORES} cores, load average {min(loads):.1f}-{max(loads):.1f}"
        console.print(parallel_rows.pp_table(results, load, CORES))


def main() -> None:
    args = parse_args()
    if args.worker:
        return run_worker(args)
    if args.cp_worker:
        return parallel_rows.run_cp_worker(int(args.cp_worker[0]), args.cp_worker[1], args.cp_lengths, args.out)
    if args.pp_worker:
        return parallel_rows.run_pp_worker(args.pp_worker, args.pp_microbatches, args.pp_steps, args.out)
    from rich.console import Console

    console = Console(width=None if os.isatty(1) else 240)
    console.print(f"uptime: {Path('/proc/loadavg').read_text().strip()} (load averages 1/5/15 min, runnable/total)")
    results = []
    with tempfile.TemporaryDirectory(prefix="isotrain-parallel-bench-") as tmp:
        if args.cp_memory or args.pipeline:
            run_sections(console, args, Path(tmp))
            if not args.layouts_given:
                return
        for key in args.layouts:
            result = launch(key, args, Path(tmp) / f"{key}.json", Path(tmp) / f"{key}.log")
            results.append(result)
            status = result.get("error") or f"{summarise(result)['tokens_per_s']:.0f} tokens/s"
            console.print(f"{LAYOUTS[key][0]}: {status} ({result.get('launch_wall_s', 0):.0f} s in all)")
    print_table(console, results, args)
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=1))
        console.print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
