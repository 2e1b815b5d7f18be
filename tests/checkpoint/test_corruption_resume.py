"""Resume never trusts a damaged checkpoint: `resume=auto` falls back to the previous valid one and
says so, a damaged `resume=PATH` is refused, and nothing on disk is deleted along the way."""

from __future__ import annotations

import shutil

import pytest

from helpers import TINY_RUN, counted_metrics
from zygote import run_isotrain
from isotrain.checkpoint.manifest import verify_checkpoint

TINY = [*TINY_RUN, "train.deterministic=true", "checkpoint.every_steps=2"]


def train(run_dir, *overrides: str):
    return run_isotrain(["train", *TINY, f"output_dir={run_dir}", *overrides])




def snapshot(run_dir) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """4 uninterrupted steps with checkpoints at 2 and 4."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = train(run_dir, "train.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture
def run_dir(reference, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(reference, copy)
    return copy


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_auto_resume_falls_back_to_the_previous_valid_checkpoint(reference, run_dir):
    root = run_dir / "checkpoints"
    flip_byte(root / "step-00000004" / "train_state" / "optimizer.safetensors")
    damaged = (root / "step-00000004" / "train_state" / "optimizer.safetensors").read_bytes()

    proc = train(run_dir, "train.max_steps=6", "checkpoint.keep_last=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "checkpoint step-00000004 is invalid (" in output and "optimizer.safetensors" in output
    assert "trying the previous one" in output
    assert f"resumed from {root / 'step-00000002'} at step 2" in output
    # The run redoes steps 3 and 4 exactly as the first time, then goes on.
    assert counted_metrics(run_dir)[:4] == counted_metrics(reference)
    assert [row["step"] for row in counted_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]

    # The damaged checkpoint is kept aside, byte for byte; rotation (keep_last=1) never counted it.
    aside = list(root.glob("step-00000004.skipped-*"))
    assert len(aside) == 1 and "moved step-00000004 aside" in output
    assert (aside[0] / "train_state" / "optimizer.safetensors").read_bytes() == damaged
    assert sorted(p.name for p in root.glob("step-*") if "." not in p.name) == ["step-00000006"]
    assert verify_checkpoint(root / "step-00000006") == []
    assert (root / "latest").read_text().strip() == "step-00000006"


@pytest.mark.slow
def test_a_damaged_checkpoint_named_by_path_is_refused(run_dir):
    target = run_dir / "checkpoints" / "step-00000004"
    (target / "manifest.json").unlink()
    before = snapshot(run_dir)
    proc = train(run_dir, "train.max_steps=6", f"checkpoint.resume={target}")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and f"{target / 'manifest.json'} is missing" in message
    assert f"isotrain ckpt verify {target}" in message
    assert snapshot(run_dir) == before  # nothing written, nothing removed


@pytest.mark.slow
def test_when_no_checkpoint_is_valid_the_run_stops_instead_of_starting_over(run_dir):
    root = run_dir / "checkpoints"
    flip_byte(root / "step-00000004" / "model.safetensors")
    (root / "step-00000002" / "tokenizer.json").unlink()
    before = snapshot(run_dir)
    proc = train(run_dir, "train.max_steps=6")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    output = proc.stdout + proc.stderr
    assert "checkpoint step-00000004 is invalid" in output and "checkpoint step-00000002 is invalid" in output
    assert f"error: no checkpoint in {root} is valid" in proc.stderr
    assert snapshot(run_dir) == before
