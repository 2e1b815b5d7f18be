"""The memory estimate next to a real run's peak memory, for a few models, settings and parallel layouts.

For each case: VmRSS before building, VmHWM reset (5 > /proc/self/clear_refs), the model built by isotrain's
builder (parallelised for the layout), isotrain's AdamW, two `train_step`s on random full-length micro-batches
(the second one has the optimizer moments from the start), then VmHWM − VmRSS-before = the measured peak
increase, worst rank. On a CUDA device the measurement is `torch.cuda.max_memory_allocated` minus what was
allocated before building instead. The estimate is `isotrain estimate-memory` of the same config and world
size. On CPU, glibc keeps freed blocks, and allocator slack and the per-op scratch of matmul/attention kernels
are outside the estimate; MALLOC_MMAP_THRESHOLD_ is fixed so large frees return to the system.

    MALLOC_MMAP_THRESHOLD_=1048576 python bench/memory.py [dense] [moe] [--layouts 1x1x1 1x2x1 1x1x2 1x2x1x2]

A layout is dp_replicate x dp_shard x tp [x ep]; layouts of more than one process are launched with torchrun
(one thread per rank) and use the first dense case and the first MoE case (only the MoE one for an ep > 1
layout).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from isotrain.config import build_config
from isotrain.memory.estimate import estimate_memory
from isotrain.models.tokenizer import train_tokenizer
from isotrain.models.unwrap import hf_model
from isotrain.moe.settings import router_settings
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.train.setup import prepare_model, step_options
from isotrain.train.step import train_step

CASES = [  # (hidden, layers, vocab, micro, seq, dtype, checkpointing, experts: 0 = dense Llama, else qwen3_moe top-2)
    (256, 4, 8192, 8, 256, "float32", "none", 0),
    (256, 4, 8192, 8, 256, "float32", "full", 0),
    (256, 4, 8192, 8, 256, "bfloat16", "none", 0),
    (512, 4, 8192, 4, 256, "float32", "none", 0),
    (256, 4, 8192, 8, 256, "float32", "none", 8),
]


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def case_config(hidden, layers, vocab, micro, seq, dtype, checkpointing, experts, layout=(1, 1, 1, 1)):
    model = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 16 * 16 + 16,
             "num_hidden_layers": layers, "num_attention_heads": max(hidden // 64, 4),
             "num_key_value_heads": max(hidden // 64, 4), "max_position_embeddings": seq, "vocab_size": vocab}
    if experts:
        model.update(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden,
                     decoder_sparse_step=1, mlp_only_layers=[])
    replicate, shard, tp, ep = layout
    return build_config({"model": {"config": model, "dtype": dtype}, "data": {"max_seq_len": seq},
                         "train": {"micro_batch_size": micro, "global_batch_size": micro * replicate * shard,
                                   "activation_checkpointing": checkpointing},
                         "parallel": {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "ep": ep}})


def measure(cfg, tokenizer, info, parallel) -> int:
    """This rank's peak increase over building the model and two optimizer steps (bytes)."""
    micro, seq, vocab = cfg.train.micro_batch_size, cfg.data.max_seq_len, cfg.model.config["vocab_size"]
    ids = torch.randint(0, vocab, (micro, seq), generator=torch.Generator().manual_seed(parallel.dp_rank))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).expand(micro, seq).clone(),
             "segment_ids": torch.zeros(micro, seq, dtype=torch.long), "num_input_tokens": micro * seq,
             "num_trained_tokens": micro * seq}
    gc.collect()
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    model, optimizer = prepare_model(cfg, info, tokenizer, parallel)
    options = step_options(cfg, parallel, router=router_settings(cfg.moe, hf_model(model).config))
    for _ in range(2):
        train_step(model, optimizer, [batch], 1e-4, options, info.device)
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - before
    del model, optimizer
    gc.collect()
    return peak


def layout_of(text: str) -> tuple[int, int, int, int]:
    parts = [int(p) for p in text.split("x")]
    if len(parts) not in (3, 4) or min(parts) < 1:
        raise SystemExit(f"layout {text!r}: use dp_replicate x dp_shard x tp [x ep], e.g. 1x2x1 or 1x2x1x2")
    return (*parts, 1)[:4] if len(parts) == 3 else tuple(parts)


def run_cases(cases, layout, out: Path | None) -> list[dict]:
    """Measure `cases` on this process (and, under torchrun, every rank); rank 0 returns the rows."""
    import torch.distributed as dist

    info = init_distributed()
    dims = ParallelDims(*layout[:3], ep=layout[3])
    parallel = build_parallel(dims, info.device, info.rank)
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    rows = []
    for case in cases:
        cfg = case_config(*case, layout=layout)
        peak = measure(cfg, tokenizer, info, parallel)
        if dist.is_initialized():
            worst = torch.tensor([peak], dtype=torch.int64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            peak = int(worst)
        rows.append({"case": list(case), "layout": list(layout), "measured": peak, "device": info.device.type})
    if info.is_main and out is not None:
        out.write_text(json.dumps(rows))
    shutdown_distributed()
    return rows


def launch(cases, layout) -> list[dict]:
    """One torchrun launch of this script for a multi-process layout (one thread per rank)."""
    nproc = math.prod(layout[:3])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   __file__, "--worker", "x".join(map(str, layout)), "--out", str(out),
                   "--cases", json.dumps([list(c) for c in cases])]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"layout {'x'.join(map(str, layout))} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kinds", nargs="*", help="`dense` and/or `moe`: only these models (default: both).")
    parser.add_argument("--layouts", nargs="+", default=["1x1x1"], help="dp_replicate x dp_shard x tp [x ep].")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_cases([tuple(c) for c in json.loads(args.cases)], layout_of(args.worker), args.out)
        return
    kinds = set(args.kinds) or {"dense", "moe"}
    if kinds - {"dense", "moe"}:
        parser.error(f"unknown model kind(s) {sorted(kinds - {'dense', 'moe'})}; use dense and/or moe")
    rows = []
    for layout in map(layout_of, args.layouts):
        cases = [c for c in CASES if ("moe" if c[-1] else "dense") in kinds]
        if math.prod(layout[:3]) == 1:
            rows += run_cases(cases, layout, None)
            continue
        # Expert parallelism needs an MoE model; tensor parallelism takes both (MoE experts replicated over TP).
        wanted = ["moe"] if layout[3] > 1 else sorted(kinds)
        first = [next((c for c in cases if bool(c[-1]) == (kind == "moe")), None) for kind in wanted]
        rows += launch([c for c in first if c is not None], layout)
    device = rows[0]["device"] if rows else "cpu"
    what = "max_memory_allocated increase" if device == "cuda" else "peak RSS increase"
    table = Table(title=f"estimate vs measured {what}, worst rank (MB = 1e6 bytes)")
    for column in ("model", "layout", "dtype", "checkpointing", "micro × seq", "estimate MB", "measured MB",
                   "measured / estimate"):
        table.add_column(column, justify="right")
    for row in rows:
        case, layout = tuple(row["case"]), tuple(row["layout"])
        cfg = case_config(*case, layout=layout)
        estimate = estimate_memory(cfg, math.prod(layout[:3]), vocab_size=case[2]).total_bytes
        hidden, layers, vocab, micro, seq, dtype, checkpointing, experts = case
        name = f"h{hidden} L{layers} V{vocab}" + (f" MoE {experts}×top-2" if experts else "")
        table.add_row(name, "x".join(map(str, layout)), dtype, checkpointing, f"{micro} × {seq}",
                      f"{estimate / 1e6:.1f}", f"{row['measured'] / 1e6:.1f}", f"{row['measured'] / estimate:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
