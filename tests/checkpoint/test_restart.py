"""A rank dies, torchrun restarts the job by itself, and the job resumes exactly (issue #32, invariant 4).

One worker of a 2-process FSDP2 (or DDP) run under `torchrun --max-restarts 1` is SIGKILLed in the first step it
begins after a checkpoint is committed (a start-up hook in its own process, KILLER below). torchrun stops the other
worker (which ends at once on that SIGTERM, naming the dead rank) and starts the group again; the new group meets
in torchrun's store, finds the checkpoint and finishes. The job exits 0 by itself, and its metrics, final model and
final checkpoint are those of a run never interrupted.
`--standalone` is torchrun's c10d rendezvous on a port of its own choosing: no port has to stay free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HANG_S, REPO, TINY_RUN, counted_metrics, failure, subprocess_env
from isotrain.checkpoint.layout import committed
from isotrain.checkpoint.manifest import verify_checkpoint
from zygote import run_forked_ranks, run_isotrain

MAX_STEPS = 8
KILL_AFTER_STEP = 2
LAYOUTS = {"fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
           "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"]}


def run_args(run_dir: Path, cache: Path, layout: str) -> list[str]:
    return ["-m", "isotrain", "train", *TINY_RUN, "train.deterministic=true", *LAYOUTS[layout],
            "checkpoint.every_steps=2", f"train.max_steps={MAX_STEPS}", f"output_dir={run_dir}",
            f"data.cache_dir={cache}"]


# Loaded at start-up by every process of the killed job (a sitecustomize module on its PYTHONPATH). In the first
# start's worker of rank 1 it wraps the train step: the first step that worker begins once checkpoint
# KILL_AFTER_STEP is committed SIGKILLs it, its peer already in that step, like a node losing power. The kill
# comes from the run's own progress, never from a test that must catch the run in time.
KILLER = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    from pathlib import Path

    import isotrain.train.step as step

    committed, original = Path(os.environ["ISOTRAIN_TEST_KILL_AFTER"]), step.train_step

    def train_step(*args, **kwargs):
        if committed.is_dir():  # a step directory appears only by the commit's rename
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    step.train_step = train_step  # before isotrain.recipes.sft imports it by name
"""


def kill_rank_after_commit(cmd: list[str], run_dir: Path, step: int) -> subprocess.CompletedProcess:
    """Run `cmd` (torchrun) with rank 1 of its first start SIGKILLed in the first step after checkpoint `step` is
    committed; the job ends by itself."""
    hook = run_dir.parent / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILLER)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    env["ISOTRAIN_TEST_KILL_AFTER"] = str(run_dir / "checkpoints" / f"step-{step:08d}")
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_resumes_exactly(tmp_path, layout):
    cache = tmp_path / "cache"
    # The reference, never interrupted, on 2 forked ranks (no interpreter start-up); the killed job is torchrun's.
    straight = run_forked_ranks(2, run_args(tmp_path / "straight" / "run", cache, layout)[2:])
    assert straight.returncode == 0, failure(straight)
    straight_dir = tmp_path / "straight" / "run"

    run_dir = tmp_path / "restarted" / "run"
    run_dir.parent.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           *run_args(run_dir, cache, layout)]
    proc = kill_rank_after_commit(cmd, run_dir, step=KILL_AFTER_STEP)

    assert proc.returncode == 0, failure(proc)  # torchrun restarted the group, and the group finished
    assert "torchrun restarted this job after a worker failed (restart 1 of at most 1): resuming at step" \
        in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    # The surviving worker of the first start, whose step's collective failed with its peer gone, ends itself on
    # torchrun's SIGTERM with the sentence naming the dead rank; one that waited for the dead rank's report would be
    # SIGKILLed by torchrun after its grace (30 s later, silently), and the restart held up that long.
    assert "rank 1 did not arrive at a collective" in proc.stderr, proc.stderr[-3000:]
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
    first = run_isotrain(args)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    restarted = run_isotrain(args)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert ("torchrun restarted this job after a worker failed (restart 1 of at most 3): resuming at step 2; "
            "steps 3-4 of the failed start are run again") in restarted.stdout, restarted.stdout[-3000:]
    assert [row["step"] for row in counted_metrics(run_dir)] == [1, 2, 3, 4]
