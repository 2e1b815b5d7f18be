"""bench/gpu_check.py on CPU (`--dry-run`: tiny models, seconds), so that the GPU check runs the day a GPU is lent.

Its three parts run as on a GPU: the CUDA tests are collected and reported (every one skipped here, with the
reason), every memory term is measured and compared, and every speed tool but the compiled one trains.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import HANG_S, REPO, subprocess_env

TOOLS = ["minimal loop", "isotrain eager", "HF Trainer", "isotrain packed", "isotrain packed varlen",
         "minimal loop (again)"]


@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] and result["environment"]["device"] == "cpu"

    cases = result["tests"]["cases"]
    assert len(cases) >= 15 and not result["tests"]["timed_out"]
    assert {case["outcome"] for case in cases} == {"skipped"}
    assert all("needs a CUDA GPU" in case["detail"] for case in cases)

    assert [(m["dtype"], m["activation_checkpointing"]) for m in result["memory"]] == [
        ("float32", "none"), ("bfloat16", "none"), ("bfloat16", "full")]
    for setting in result["memory"]:
        measured = {t["term"]: t for t in setting["terms"] if t["measured"] is not None}
        assert {"parameters", "gradients", "optimizer moments", "activations", "logits and loss"} <= set(measured)
        assert all(t["ok"] for t in measured.values()), setting["terms"]

    rows = result["speed"]["rows"]
    assert [row["tool"] for row in rows] == TOOLS
    assert all(row["tokens_per_s"] > 0 and len(row["step_s"]) == result["speed"]["steps"] for row in rows)
    packed = next(row for row in rows if row["tool"] == "isotrain packed")
    assert packed["attended_length"] < result["speed"]["seq_len"]  # documents attend within themselves
    assert set(result["speed"]["ratios"]) == {"eager / minimal loop", "eager / HF Trainer",
                                                "packed (real tokens) / eager",
                                                "packed varlen (real tokens) / eager", "packed varlen / packed sdpa"}

    table = (out / "gpu_check.md").read_text()
    assert "## CUDA tests:" in table and "## Memory: bfloat16, activation checkpointing full" in table
    assert "| isotrain packed |" in table and "| isotrain packed varlen |" in table


def test_without_a_gpu_and_without_dry_run_it_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)], cwd=REPO,
                          env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 2
    assert "no CUDA GPU is visible" in proc.stdout and "--dry-run" in proc.stdout


@pytest.mark.slow
def test_step_profile_dry_run_puts_the_step_into_categories(tmp_path):
    out = tmp_path / "profile"
    proc = subprocess.run([sys.executable, "bench/gpu_profile.py", "--dry-run", "--out", str(out), "--tools",
                           "isotrain eager"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_profile.json").read_text())
    [row] = result["rows"]
    assert row["tool"] == "isotrain eager" and row["step_ms"] > 0
    # a Llama step's operators fall into categories (their shares depend on the machine), adding up to the busy time
    assert row["categories"]["matrix products"] > 0 and row["categories"]["attention"] > 0
    assert sum(row["categories"].values()) == pytest.approx(row["busy_ms"])
    assert 0 < row["busy_share"] <= 1.0
    assert "| matrix products |" in (out / "gpu_profile.md").read_text()
