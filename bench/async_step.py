"""What a checkpoint costs the training loop in a real run: `isotrain train` with async saves, with sync
saves and with none, each in a fresh process, the same model, data and steps.

For each run, every loop iteration's time is its step (`step_s` in metrics.jsonl: forward, backward, the
wait for an async save's host copy before the update, the update) plus the time of the save call that
follows it, if any (timed here around `CheckpointManager.maybe_save`). The table compares:

    median step s      the median iteration without a save in it or right after one
    save step s        the step that starts a save: the save call (after step k) plus step k + 1, which
                       runs beside an async save's host copy and waits for it before its update
    x median           save step s / median step s (the target for async saves: at most 1.10)
    blocked s          the manager's own count of time the loop waited on saves (whole run)

The model is a fresh Llama built by isotrain (default hidden 512, 8 layers, intermediate 1376, vocab
32000, untied: 58M parameters; weights + AdamW moments = 0.70 GB per checkpoint), fp32, on generated
text of --seq tokens per row, --batch rows per step, one micro-batch.

    python bench/async_step.py [--steps 16] [--every 4] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("async", "sync", "none")


def _text(rng: random.Random, chars: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "train", "layout", "tensor", "rank"]
    out = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(words))
    return " ".join(out)


def _run(args, mode: str, work: Path) -> dict:
    """One training run in this process; returns its iteration times and the manager's blocked time."""
    from isotrain.checkpoint.manager import CheckpointManager
    from isotrain.config import build_config
    from isotrain.recipes.sft import train

    data = work / "data.jsonl"
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"text": _text(rng, 4 * args.seq)}) + "\n" for _ in range(64 * args.batch)))
    heads = max(1, args.hidden // 64)
    cfg = build_config({
        "output_dir": str(work / mode),
        "model": {"config": {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                             "num_attention_heads": heads, "num_key_value_heads": heads,
                             "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                             "tie_word_embeddings": False, "max_position_embeddings": args.seq}},
        "tokenizer": {"type": "bpe", "vocab_size": args.vocab},
        "data": {"path": str(data), "format": "text", "max_seq_len": args.seq, "packing": True,
                 "overflow": "truncate"},
        "eval": {"path": None},
        "train": {"global_batch_size": args.batch, "micro_batch_size": args.batch, "max_steps": args.steps,
                  "lr": 1e-4},
        "checkpoint": {"every_steps": args.every if mode != "none" else 0, "keep_last": 2,
                       "async": mode == "async"},
        "logging": {"progress": False},
    })
    saves: dict[int, float] = {}
    original = CheckpointManager.maybe_save

    def timed(self, step, counters, stopping=False):
        start = time.perf_counter()
        saved = original(self, step, counters, stopping)
        if saved:
            saves[step] = time.perf_counter() - start
        return saved

    CheckpointManager.maybe_save = timed
    blocked = {}
    original_wait = CheckpointManager.wait

    def wait(self):  # the manager's count, read once the loop is done with it
        original_wait(self)
        blocked["s"] = self.blocked_s

    CheckpointManager.wait = wait
    train(cfg)
    rows = [json.loads(line) for line in (work / mode / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s = {row["step"]: row["step_s"] for row in rows if "step_s" in row}
    return {"step_s": step_s, "saves": saves, "blocked_s": blocked.get("s", 0.0)}


def _summary(result: dict, warmup: int) -> dict:
    step_s = {int(k): v for k, v in result["step_s"].items()}
    saves = {int(k): v for k, v in result["saves"].items()}
    final = max(step_s)
    # Saves after the last step happen once training is over: not part of a step.
    inner = [s for s in saves if s < final]
    near = {s for s in inner} | {s + 1 for s in inner}
    plain = [t for step, t in step_s.items() if step > warmup and step not in near]
    median = statistics.median(plain)
    costs = [saves[s] + step_s[s + 1] for s in inner if s > warmup]
    return {"median": median, "save_step": statistics.median(costs) if costs else None,
            "blocked": result["blocked_s"], "saves": len(inner)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of every figure")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, out = args.worker.split(":", 1)
        with tempfile.TemporaryDirectory() as tmp:
            Path(out).write_text(json.dumps(_run(args, mode, Path(tmp))))
        return
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("modes", "worker")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            out = Path(tmp) / f"{mode}.json"
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.run([sys.executable, __file__, *forwarded, f"--worker={mode}:{out}"], env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"the {mode} run failed:\n{proc.stderr[-3000:]}")
            results[mode] = _summary(json.loads(out.read_text()), args.warmup)
    load = os.getloadavg()[0]
    print(f"async_step: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.batch} x "
          f"{args.seq} tokens per step, save every {args.every} of {args.steps} steps; load average {load:.1f}")
    print("| saves | median step s | save step s | x median | blocked s (run) |")
    print("|---|---:|---:|---:|---:|")
    for mode, row in results.items():
        save_step = "" if row["save_step"] is None else f"{row['save_step']:.3f}"
        ratio = "" if row["save_step"] is None else f"{row['save_step'] / row['median']:.3f}"
        print(f"| {mode} ({row['saves']} in the run) | {row['median']:.3f} | {save_step} | {ratio} | "
              f"{row['blocked']:.2f} |")


if __name__ == "__main__":
    main()
