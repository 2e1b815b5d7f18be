"""Trials of a rank that dies: one worker of a 2-process run under `torchrun --max-restarts 1` is SIGKILLed at a
random point, torchrun restarts the group, and the job must finish by itself with the final weights, optimizer
state and metrics of a run never interrupted, byte for byte (deterministic mode, CPU), its checkpoints verified.

    python scripts/restart_trials.py --trials 10 --seed 0 --work /tmp/restart-trials

Each trial draws (from --seed) a layout (FSDP2 2 or DDP 2), the rank to kill, the step and where in it: as the
step begins, or after its backward, just before the optimizer's update. The kill comes from a start-up hook in
the chosen worker (a sitecustomize module), counted in steps of that worker's first start, so the trial does not
depend on timing. tests/checkpoint/test_restart.py runs the same thing at one fixed point in the suite; this
script draws many points and prints one row per trial. Exit status 0 when every trial held.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS, EVERY = 8, 2
LAYOUTS = {"fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
           "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"]}
TINY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
        "train.global_batch_size=8", "train.micro_batch_size=4", "logging.progress=false", "eval.path=null",
        "train.deterministic=true", f"checkpoint.every_steps={EVERY}", f"train.max_steps={MAX_STEPS}"]

# In the first start's worker of rank ISOTRAIN_TRIAL_RANK: SIGKILL at the ISOTRAIN_TRIAL_STEP-th train step this
# worker runs, as it begins ("begin") or once its gradients are complete, before the optimizer's update ("update").
HOOK = """
import os
if os.environ.get("RANK") == os.environ["ISOTRAIN_TRIAL_RANK"] and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal

    import torch
    import isotrain.train.step as step

    target, where, seen = int(os.environ["ISOTRAIN_TRIAL_STEP"]), os.environ["ISOTRAIN_TRIAL_WHERE"], [0]
    original_step, original_update = step.train_step, torch.optim.AdamW.step

    def train_step(*args, **kwargs):
        seen[0] += 1
        if seen[0] == target and where == "begin":
            os.kill(os.getpid(), signal.SIGKILL)
        return original_step(*args, **kwargs)

    def update(self, *args, **kwargs):
        if seen[0] == target and where == "update":
            os.kill(os.getpid(), signal.SIGKILL)
        return original_update(self, *args, **kwargs)

    step.train_step = train_step  # before isotrain.recipes.sft imports it by name
    torch.optim.AdamW.step = update
"""


def launch(run_dir: Path, cache: Path, layout: str, env: dict, restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "-m", "isotrain", "train", *TINY, *LAYOUTS[layout],
           f"output_dir={run_dir}", f"data.cache_dir={cache}"]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)


def base_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def saved_files(run_dir: Path) -> dict[str, bytes]:
    """The final model and the last checkpoint's tensors and metrics, by path in the run directory."""
    from isotrain.checkpoint.layout import committed

    final = committed(run_dir / "checkpoints")[-1][1]
    paths = [*(run_dir / "model").glob("*.safetensors"), *final.rglob("*.safetensors")]
    files = {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in paths}
    files["metrics"] = b"\n".join(_counted(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines())
    return files


def _counted(line: bytes) -> bytes:
    import json

    row = json.loads(line)
    return json.dumps({k: row[k] for k in ("step", "loss", "lr", "grad_norm", "tokens_seen", "trained_tokens")}).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, required=True, help="A directory for the runs (emptied first).")
    args = parser.parse_args()
    from isotrain.checkpoint.layout import committed
    from isotrain.checkpoint.manifest import verify_checkpoint

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    cache = args.work / "cache"
    env = base_env()
    reference = {}
    for layout in LAYOUTS:
        proc = launch(args.work / f"straight-{layout}", cache, layout, env, restarts=0)
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            return 1
        reference[layout] = saved_files(args.work / f"straight-{layout}")

    hook = args.work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    rng = random.Random(args.seed)
    print("| trial | layout | killed | exit | restarted | final weights, optimizer, metrics | checkpoints verify | s |")
    print("|---:|---|---|---:|---|---|---|---:|")
    held = 0
    for trial in range(1, args.trials + 1):
        layout, rank = rng.choice(sorted(LAYOUTS)), rng.randrange(2)
        step, where = rng.randint(1, MAX_STEPS), rng.choice(["begin", "update"])
        run_dir = args.work / f"trial-{trial:02d}"
        trial_env = {**env, "PYTHONPATH": os.pathsep.join([str(hook), env["PYTHONPATH"]]),
                     "ISOTRAIN_TRIAL_RANK": str(rank), "ISOTRAIN_TRIAL_STEP": str(step), "ISOTRAIN_TRIAL_WHERE": where}
        started = time.perf_counter()
        proc = launch(run_dir, cache, layout, trial_env, restarts=1)
        seconds = time.perf_counter() - started
        restarted = "restart 1 of at most 1" in proc.stdout
        same = verified = "-"
        if proc.returncode == 0:
            got = saved_files(run_dir)
            same = "identical" if got == reference[layout] else "DIFFERENT: " + ", ".join(
                sorted(k for k in set(got) | set(reference[layout]) if got.get(k) != reference[layout].get(k)))
            problems = [p for _, d in committed(run_dir / "checkpoints") for p in verify_checkpoint(d)]
            verified = "yes" if not problems else f"NO: {problems[:2]}"
        ok = proc.returncode == 0 and restarted and same == "identical" and verified == "yes"
        held += ok
        print(f"| {trial} | {layout} | rank {rank}, step {step} ({where}) | {proc.returncode} | "
              f"{'yes' if restarted else 'no'} | {same} | {verified} | {seconds:.0f} |", flush=True)
        if not ok:
            (args.work / f"trial-{trial:02d}.log").write_text(proc.stdout + "\n---\n" + proc.stderr)
    print(f"\n{held} of {args.trials} trials held")
    return 0 if held == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
