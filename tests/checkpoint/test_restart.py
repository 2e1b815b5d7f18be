"""A rank dies, torchrun restarts the job by itself, and the job resumes exactly (issue #32, invariant 4).

One worker of a 2-process FSDP2 (or DDP) run under `torchrun --max-restarts 1` is SIGKILLed as soon as a checkpoint is
committed (the test watches the checkpoint directory, as `helpers.kill_after_commit` does). torchrun stops the other
worker and starts the group again; the new group meets in torchrun's store, finds the checkpoint and finishes. The
job exits 0 by itself, and its metrics, final model and final checkpoint are those of a run never interrupted.
`--standalone` is torchrun's c10d rendezvous on a port of its own choosing: no port has to stay free.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (HANG_S, REPO, TINY_RUN, counted_metrics, descendants, failure, isotrain_cli, subprocess_env,
                     torchrun)
from isotrain.checkpoint.layout import committed
from isotrain.checkpoint.manifest import verify_checkpoint

MAX_STEPS = 8
KILL_AFTER_STEP = 2
LAYOUTS = {"fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
           "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"]}


def run_args(run_dir: Path, cache: Path, layout: str) -> list[str]:
    return ["-m", "isotrain", "train", *TINY_RUN, "train.deterministic=true", *LAYOUTS[layout],
            "checkpoint.every_steps=2", f"train.max_steps={MAX_STEPS}", f"output_dir={run_dir}",
            f"data.cache_dir={cache}"]


def worker_of_rank(launcher: subprocess.Popen, rank: int) -> tuple[int, int]:
    """(pid, start tick) of the launcher's worker process of global rank `rank`, waited for until it exists."""
    deadline = time.monotonic() + HANG_S
    while True:
        assert launcher.poll() is None, "torchrun ended before its workers started"
        assert time.monotonic() < deadline, f"no worker of rank {rank} appeared"
        for pid in descendants(launcher.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
                return pid, int(stat[19])
        time.sleep(0.01)


def kill_rank_after_commit(cmd: list[str], run_dir: Path, rank: int, step: int) -> subprocess.CompletedProcess:
    """Run `cmd` (torchrun); SIGKILL its first worker of `rank` once checkpoint `step` is committed; wait for the
    job to end by itself."""
    target = run_dir / "checkpoints" / f"step-{step:08d}"
    with open(run_dir.parent / "out.txt", "w+") as out, open(run_dir.parent / "err.txt", "w+") as err:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, start_new_session=True, stdout=out,
                                    stderr=err, text=True)
        try:
            pid, started = worker_of_rank(launcher, rank)
            deadline = time.monotonic() + HANG_S
            while not target.is_dir():  # a step directory appears only by the commit's rename
                assert launcher.poll() is None, "the job ended before its checkpoint was committed"
                assert time.monotonic() < deadline, "the run never committed its checkpoint"
                time.sleep(0.002)
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            assert int(stat[19]) == started and stat[0] not in "ZX", f"rank {rank} ended before the kill"
            os.kill(pid, signal.SIGKILL)
            launcher.wait(timeout=HANG_S)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, launcher.returncode, out.read(), err.read())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_resumes_exactly(tmp_path, layout):
    cache = tmp_path / "cache"
    straight = torchrun(2, run_args(tmp_path / "straight" / "run", cache, layout))
    assert straight.returncode == 0, failure(straight)
    straight_dir = tmp_path / "straight" / "run"

    run_dir = tmp_path / "restarted" / "run"
    run_dir.parent.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           *run_args(run_dir, cache, layout)]
    proc = kill_rank_after_commit(cmd, run_dir, rank=1, step=KILL_AFTER_STEP)

    assert proc.returncode == 0, failure(proc)  # torchrun restarted the group, and the group finished
    assert "torchrun restarted this job after a worker failed (restart 1 of at most 1): resuming at step" \
        in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    assert counted_metrics(run_dir) == counted_metrics(straight_dir)
    final = committed(run_dir / "checkpoints")[-1][1]
    assert final.name == f"step-{MAX_STEPS:08d}" and verify_checkpoint(final) == []
    files = sorted(p.relative_to(run_dir).as_posix() for p in [*(run_dir / "model").glob("*.safetensors"),
                                                                *final.rglob("*.safetensors")])
    assert any("optimizer" in name for name in files)
    for name in files:
        assert (run_dir / name).read_bytes() == (straight_dir / name).read_bytes(), name


def test_a_restarted_start_resumes_even_with_resume_never_and_says_what_it_runs_again(tmp_path, monkeypatch):
    """What a restarted start reads from torchrun is TORCHELASTIC_RESTART_COUNT: set by hand here on one plain
    process. Its first start (resume=never) logged steps 1-4 but committed only step 2 (step 4's checkpoint removed,
    as a kill before its commit would leave it)."""
    run_dir = tmp_path / "run"
    args = ["train", *TINY_RUN, "checkpoint.every_steps=2", "checkpoint.resume=never", "train.log_every=1",
            "train.max_steps=4", f"output_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    first = isotrain_cli(args)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    restarted = isotrain_cli(args)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert ("torchrun restarted this job after a worker failed (restart 1 of at most 3): resuming at step 2; "
            "steps 3-4 of the failed start are run again") in restarted.stdout, restarted.stdout[-3000:]
    assert [row["step"] for row in counted_metrics(run_dir)] == [1, 2, 3, 4]
