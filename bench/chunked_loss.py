"""Peak memory and step time of the SFT step with and without the chunked cross-entropy (train.loss_chunk_tokens).

A fresh Llama built by isotrain (hidden 256, 2 layers, vocabulary 32000, fp32), one process, micro-batches of
2 × 1024 tokens, every token trained; two `train_step`s (the second with AdamW's moments), measured as in
bench/memory.py: VmHWM − VmRSS before building the model (VmHWM reset first), one fresh process per setting so
that no allocation of one setting is reused by another. Then a few more steps are timed (median).

    MALLOC_MMAP_THRESHOLD_=1048576 python bench/chunked_loss.py [--chunks 0 4096 1024 256] [--steps 3]

0 is the unchunked loss. The fp32 logits of one micro-batch are micro × seq × vocab × 4 bytes (262 MB here).

    python bench/chunked_loss.py --loss-only [--steps 10]

times the loss alone (forward + backward from the final hidden states, 2 × 1024 tokens, hidden 256, vocabulary
8192 as bench/train_throughput.py's model): unchunked, chunked eager (what isotrain runs) and chunked with each
chunk's head + cross-entropy compiled (torch.compile, dynamic shapes), interleaved, median ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

HIDDEN, LAYERS, VOCAB, MICRO, SEQ = 256, 2, 32000, 2, 1024


def worker(chunk_tokens: int, steps: int) -> dict:
    from memory import case_config, measure  # bench/memory.py: the same peak measurement

    from isotrain.models.tokenizer import train_tokenizer
    from isotrain.parallel.dims import ParallelDims
    from isotrain.parallel.dist import init_distributed
    from isotrain.parallel.mesh import build_parallel
    from isotrain.train.setup import prepare_model
    from isotrain.train.setup import step_options
from isotrain.train.step import train_step

    torch.manual_seed(0)
    cfg = case_config(HIDDEN, LAYERS, VOCAB, MICRO, SEQ, "float32", "none", 0)
    cfg.train.loss_chunk_tokens = chunk_tokens
    info = init_distributed()
    parallel = build_parallel(ParallelDims(1, 1, 1), info.device, info.rank)
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    peak = measure(cfg, tokenizer, info, parallel)
    # Timing on a model of its own (measure() frees its model): the steps after two warm-up steps.
    model, optimizer = prepare_model(cfg, info, tokenizer, parallel)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).expand(MICRO, SEQ).clone(),
             "segment_ids": torch.zeros(MICRO, SEQ, dtype=torch.long), "num_input_tokens": MICRO * SEQ,
             "num_trained_tokens": MICRO * SEQ}
    options = step_options(cfg, parallel)
    times, losses = [], []
    for step in range(2 + steps):
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, [batch], 1e-4, options, info.device).loss)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return {"chunk": chunk_tokens, "peak": peak, "step_s": statistics.median(times), "loss": losses[0]}


def loss_only(steps: int) -> None:
    """Median ms of forward + backward of the loss alone, the variants interleaved step by step."""
    import isotrain.train.chunked_loss as chunked
    from isotrain.train.loss import token_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(256, 8192, bias=False)
    hidden = torch.randn(2, 1024, 256, requires_grad=True)
    labels = torch.randint(0, 8192, (2, 1024))
    weights = torch.ones(2, 1024)
    eager_chunk = chunked.chunk_loss_sum
    compiled_chunk = torch.compile(eager_chunk, dynamic=True)

    def unchunked():
        return (token_losses(head(hidden), labels) * weights).sum()

    def chunked_with(fn):
        def run():
            chunked.chunk_loss_sum = fn
            return chunked.chunked_loss_sum(head, hidden, labels, weights, 1024)
        return run

    variants = {"unchunked": unchunked, "chunked 1024, eager": chunked_with(eager_chunk),
                "chunked 1024, compiled chunk": chunked_with(compiled_chunk)}
    times = {name: [] for name in variants}
    losses = {}
    for step in range(3 + steps):
        for name, fn in variants.items():
            start = time.perf_counter()
            loss = fn()
            loss.backward()
            if step >= 3:
                times[name].append(time.perf_counter() - start)
            losses[name] = float(loss)
            head.weight.grad = hidden.grad = None
    chunked.chunk_loss_sum = eager_chunk
    print(f"loss alone, 2 x 1024 tokens, hidden 256, vocabulary 8192, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}:")
    for name, values in times.items():
        print(f"  {name}: {1e3 * statistics.median(values):.1f} ms (loss {losses[name]:.6f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", nargs="+", type=int, default=[0, 4096, 1024, 256])
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per setting (after 2 warm-up steps).")
    parser.add_argument("--loss-only", action="store_true", help="Time the loss alone: eager vs compiled chunks.")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss_only:
        return loss_only(args.steps)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.steps)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    rows = []
    for chunk in args.chunks:
        done = subprocess.run([sys.executable, __file__, "--worker", str(chunk), "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"loss_chunk_tokens={chunk} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    logits_mb = MICRO * SEQ * VOCAB * 4 / 1e6
    table = Table(title=f"Llama h{HIDDEN} L{LAYERS} V{VOCAB}, fp32, micro-batch {MICRO} × {SEQ} "
                        f"(fp32 logits of a micro-batch: {logits_mb:.0f} MB); load average {os.getloadavg()[0]:.1f}")
    for column in ("train.loss_chunk_tokens", "peak RSS increase MB", "vs unchunked", "s / step", "first loss"):
        table.add_column(column, justify="right")
    base = next((r for r in rows if r["chunk"] == 0), rows[0])
    for row in rows:
        table.add_row(str(row["chunk"]), f"{row['peak'] / 1e6:.0f}", f"{row['peak'] / base['peak']:.2f}",
                      f"{row['step_s']:.2f}", f"{row['loss']:.6f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
