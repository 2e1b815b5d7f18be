"""A stop always keeps the work: a real Ctrl-C (SIGINT) to `isotrain train` / `isotrain rl` running with
checkpoint.every_steps=0 saves a checkpoint at the next step boundary, and the run resumed from it ends
exactly where a run that was never stopped ends (metrics rows and final weights). The stopped and the resumed
runs are ordinary launches (`python -m isotrain`); the uninterrupted reference is forked from the zygote
(tests/zygote.py), as the launcher is no part of what it is compared for."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import COUNTED, HANG_S, REPO, TINY_RUN, model_weights, run_concurrently, subprocess_env
from isotrain.checkpoint.layout import committed
from isotrain.checkpoint.manifest import verify_checkpoint
from zygote import run_isotrain

SFT = ["train", *TINY_RUN, "train.max_steps=40", "train.log_every=1", "train.deterministic=true",
       "checkpoint.every_steps=0"]
RL = ["rl", "model.name_or_path=null", "model.config.model_type=llama", "model.config.hidden_size=32",
      "model.config.intermediate_size=64", "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
      "model.config.num_key_value_heads=2", "tokenizer.type=char", "rl.prompts_per_step=4", "rl.group_size=4",
      "train.micro_batch_size=8", "train.max_steps=8", "train.log_every=1", "train.deterministic=true",
      "eval.path=null", "logging.progress=false", "checkpoint.every_steps=0"]


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "isotrain", *args]


def finish(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cli(args), env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def ctrl_c_after_first_step(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """Start a run and send it one SIGINT (what Ctrl-C sends) as soon as its first metrics row is written."""
    proc = subprocess.Popen(cli(args), env=subprocess_env(), cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S
    try:
        while not (metrics.is_file() and metrics.read_text()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def reference(args: list[str]) -> subprocess.CompletedProcess:
    proc = run_isotrain(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows(run_dir: Path, keys=COUNTED) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{key: row[key] for key in keys if key in row} for row in map(json.loads, lines)]


def check_stopped(stopped: subprocess.CompletedProcess, run_dir: Path, max_steps: int) -> int:
    """The stopped run saved a checkpoint at the step it stopped after, said so, and wrote no final model/."""
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    match = re.search(r"SIGINT received: stopped after step (\d+); checkpoint (\S+) saved \(a Hugging Face model "
                      r"directory; no final model/ is written\); run again to resume", stopped.stdout)
    assert match, stopped.stdout[-3000:]
    step = int(match[1])
    assert 1 <= step < max_steps  # stopped early: the resume below has work to do
    checkpoint = run_dir / "checkpoints" / f"step-{step:08d}"
    assert match[2] == str(checkpoint)
    assert [path for _, path in committed(run_dir / "checkpoints")] == [checkpoint]
    assert verify_checkpoint(checkpoint) == []
    assert not (run_dir / "model").exists()
    return step


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_without_periodic_checkpoints_and_the_resume_is_exact(tmp_path):
    straight, stopped_dir = tmp_path / "straight", tmp_path / "stopped"
    done = run_concurrently({
        "straight": lambda: reference([*SFT, f"output_dir={straight}"]),
        "stopped": lambda: ctrl_c_after_first_step([*SFT, f"output_dir={stopped_dir}"], stopped_dir),
    })
    step = check_stopped(done["stopped"], stopped_dir, 40)
    resumed = finish([*SFT, f"output_dir={stopped_dir}"])
    assert f"resumed from {stopped_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in resumed.stdout
    assert rows(stopped_dir) == rows(straight)  # loss, lr, grad norm and counters of all 40 steps, exactly
    final_a, final_b = model_weights(straight / "model"), model_weights(stopped_dir / "model")
    assert final_a.keys() == final_b.keys()
    assert all(final_a[name].equal(final_b[name]) for name in final_a)


@pytest.mark.slow
def test_rl_ctrl_c_saves_a_checkpoint_without_periodic_checkpoints_and_the_resume_is_exact(tmp_path):
    straight, stopped_dir = tmp_path / "straight", tmp_path / "stopped"
    done = run_concurrently({
        "straight": lambda: reference([*RL, f"output_dir={straight}"]),
        "stopped": lambda: ctrl_c_after_first_step([*RL, f"output_dir={stopped_dir}"], stopped_dir),
    })
    step = check_stopped(done["stopped"], stopped_dir, 8)
    resumed = finish([*RL, f"output_dir={stopped_dir}"])
    assert f"at step {step}" in resumed.stdout
    keys = (*COUNTED, "reward_mean", "kl", "entropy", "optimizer_steps")
    assert rows(stopped_dir, keys) == rows(straight, keys)
    assert (stopped_dir / "model" / "config.json").is_file()  # the finished run writes its final model/
    final_a, final_b = model_weights(straight / "model"), model_weights(stopped_dir / "model")
    assert all(final_a[name].equal(final_b[name]) for name in final_a)
