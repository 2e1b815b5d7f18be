"""Crash safety with real kills and a real full disk (invariants 5 and 8).

A run that saves at every step (`keep_last=1`) is SIGKILLed again and again at seeded random
instants of its saves and restarted each time with `checkpoint.resume=auto`: on 1 process and on
2 FSDP2 ranks, with sync and async saves. What each kill left on disk tells which part of a save it
hit (writing the files, committing, rotating), and the kills go on until 10 per case have hit a
save. After every kill, every committed checkpoint verifies, `latest` names one of them, there is
one as soon as the first was committed, and the next start reports and removes what the kill left
and resumes from the newest committed checkpoint. Finally the run completes with the same bytes and
metrics as a run that was never interrupted.

Start-up (importing torch and transformers) takes seconds, so every run here is forked from one process
that has done those imports (tests/zygote.py), with torchrun's environment for each rank (RANK,
WORLD_SIZE, MASTER_ADDR/PORT): real processes, real gloo collectives, real files, real SIGKILL. That a
killed run resumes exactly when started the ordinary way (`torchrun`, `python -m isotrain`) is
tests/checkpoint/test_restart.py's and tests/train/test_stop.py's.

A file-size limit (RLIMIT_FSIZE: unprivileged, and exact about which file fails), set in the forked
process, stands in for a full disk, on the one process or on one of two ranks: the save fails with one sentence on every
rank, nothing is committed or left behind, the earlier checkpoints stay valid, and the next start
resumes from them.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import HANG_S, TINY_RUN, counted_metrics
from zygote import Forked, Zygote, fork_ranks, shared_zygote
from isotrain.checkpoint.layout import committed, leftovers, read_latest
from isotrain.checkpoint.manifest import verify_checkpoint

TINY = [*TINY_RUN, "train.deterministic=true", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
        "checkpoint.resume=auto"]
KILLS_IN_SAVES = 10  # per layout and mode: 40 kills inside a save in all
MAX_STEPS = 44  # a killed run gets at most 2 steps further, and there are at most 2 * KILLS_IN_SAVES of them
FSDP2 = ["parallel.dp_replicate=1", "parallel.dp_shard=2"]
LAYOUTS = {"single": (1, []), "fsdp2": (2, FSDP2)}
SEED = int(os.environ.get("ISOTRAIN_CRASH_SEED", "20260522"))  # every failure message names it


def overrides(layout: str, run_dir, cache, *extra: str) -> list[str]:
    # One tokenized-data cache for the module: tokenizing once is enough.
    return ["train", *TINY, *LAYOUTS[layout][1], f"train.max_steps={MAX_STEPS}", f"output_dir={run_dir}",
            f"data.cache_dir={cache}", *extra]


def save_mode(mode: str) -> str:
    return f"checkpoint.async={'true' if mode == 'async' else 'false'}"


# ----- runs forked from a process that has imported everything (tests/zygote.py) -----------------


def fork_run(zygote: Zygote, layout: str, argv: list[str], log_prefix, max_file_bytes: dict | None = None,
             late_failure_s: dict | None = None) -> Forked:
    """Start a run of `layout`; its ranks' logs are `log_prefix`-rank{r}.txt (zygote.fork_ranks)."""
    nproc = LAYOUTS[layout][0]
    logs = [log_prefix.with_name(f"{log_prefix.name}-rank{rank}.txt") for rank in range(nproc)]
    return fork_ranks(zygote, nproc, argv, logs, max_file_bytes, late_failure_s)


def run_forked(zygote: Zygote, layout: str, argv: list[str], log_prefix, max_file_bytes: dict | None = None,
               late_failure_s: dict | None = None) -> Forked:
    """A forked run, waited for to its end (a hang fails the test)."""
    forked = fork_run(zygote, layout, argv, log_prefix, max_file_bytes, late_failure_s)
    forked.finish(HANG_S)
    return forked


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def zygote():
    return shared_zygote()  # the one every forked run of this test process uses: its imports are paid once


def run_single(zygote: Zygote, args: list[str], log_prefix, max_file_bytes: int | None = None
               ) -> subprocess.CompletedProcess:
    """`isotrain args` on one forked process, waited for, as `python -m isotrain` would run it (stdout and stderr
    apart)."""
    logs, errs = [log_prefix.with_name(f"{log_prefix.name}.out")], [log_prefix.with_name(f"{log_prefix.name}.err")]
    forked = fork_ranks(zygote, 1, args, logs, None if max_file_bytes is None else {0: max_file_bytes}, errs=errs)
    forked.finish(HANG_S)
    return subprocess.CompletedProcess(args, forked.exit_codes()[0], logs[0].read_text(), errs[0].read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, zygote, cache):
    """A reference run per layout, never killed, saving only its last step: saves do not change the math."""
    made = {}

    def get(layout: str):
        if layout not in made:
            run_dir = tmp_path_factory.mktemp(f"straight-{layout}") / "run"
            args = overrides(layout, run_dir, cache, f"checkpoint.every_steps={MAX_STEPS}")
            forked = run_forked(zygote, layout, args, run_dir.parent / "log")
            assert forked.exit_codes() == [0] * LAYOUTS[layout][0], forked.output()[-3000:]
            made[layout] = run_dir
        return made[layout]

    return get


# ----- what must hold on disk after any kill ----------------------------------------------------

def check_disk(root, ever_committed: bool, context: str) -> list[tuple[int, object]]:
    """Invariant 5 at any instant; returns the committed checkpoints, oldest first."""
    found = committed(root)
    for _, path in found:
        assert verify_checkpoint(path) == [], f"{context}: committed {path.name} does not verify"
    if ever_committed:
        assert found, f"{context}: no committed checkpoint is left (keep_last=1)"
    latest = read_latest(root)
    if latest is not None:
        assert latest in {path.name for _, path in found}, f"{context}: latest names {latest}, not a committed one"
    return found


def phase_of_kill(root, found, newest_before: int) -> str:
    """Which part of a save the kill interrupted, read from what it left on disk."""
    names = [path.name for path in leftovers(root)]
    newest = found[-1][0] if found else 0
    if any(name.startswith("step-") and ".tmp-" in name for name in names):
        return "writing"  # step-N.tmp-<id>/ exists: files, manifest or fsyncs, before the rename
    if any(name.startswith(".latest.tmp-") for name in names) or (
            newest > newest_before and read_latest(root) != found[-1][1].name):
        return "committing"  # renamed, `latest` not replaced yet
    if any(".old-" in name for name in names) or len(found) > 1:
        return "rotating"  # committed, the older checkpoint not deleted yet
    return "between saves"


def step_started(root, step: int, stale: set[str]) -> tuple[bool, object]:
    """Whether the save of `step` has begun (its .tmp- directory, or already committed), and the .tmp- path.

    `stale` are the previous kill's leftovers, which the run removes when it starts.
    """
    prefix = f"step-{step:08d}"
    tmp = None
    for path in root.iterdir() if root.is_dir() else []:
        if path.name == prefix:
            return True, None
        if path.name.startswith(prefix + ".tmp-") and path.name not in stale:
            tmp = path
    return tmp is not None, tmp


def kill_during_save(forked: Forked, root, step: int, stale: set[str], rng: random.Random, context: str) -> str:
    """Wait until the save of `step` begins, then SIGKILL the run at a random instant of it.

    Half of the kills land within 10 ms of the start (a save takes 11-100 ms here: 1 or 2 ranks,
    sync or async); the other half wait for manifest.json, the save's last file, and land within
    2 ms of it, in the short commit phase (fsync, rename, `latest`, rotation). Returns the aim.
    """
    aim = rng.choice(["start", "commit"])
    delay = rng.uniform(0, 0.010) if aim == "start" else rng.uniform(0, 0.002)
    deadline = time.monotonic() + HANG_S
    while True:
        assert forked.running(), f"{context}: the run ended before the kill:\n{forked.output()[-3000:]}"
        assert time.monotonic() < deadline, f"{context}: the save of step {step} never began"
        started, tmp = step_started(root, step, stale)
        if started:
            break
        time.sleep(0.0005)
    while aim == "commit" and tmp is not None and tmp.exists() and not (tmp / "manifest.json").exists():
        assert time.monotonic() < deadline, f"{context}: the save of step {step} never ended"
        time.sleep(0.0002)
    time.sleep(delay)
    forked.kill()
    return f"{aim} +{delay * 1000:.1f} ms"


@dataclass
class Harness:
    """One run directory killed again and again; what each kill left is checked by the next start."""

    layout: str
    mode: str
    args: list[str]
    root: Path
    history: list[str]  # one line per kill, shown with every failure: enough to replay it
    newest: tuple | None = None  # (step, path) of the newest committed checkpoint: where the next start resumes
    left: tuple[str, ...] = ()  # the last kill's leftovers, which the next start must report and remove

    def context(self) -> str:
        return f"{self.layout}/{self.mode}, seed {SEED}, kills so far:\n  " + "\n  ".join(self.history)

    def check_start(self, output: str) -> None:
        """The start after a kill removed what the kill left, saying so, and resumed from the newest
        committed checkpoint, never from a partial one."""
        where = f"{self.context()}\n{output[-3000:]}"
        if self.left:
            removed = f"removed {len(self.left)} leftover(s) of an interrupted save: {', '.join(self.left)}"
            assert removed in output, where
        if self.newest:
            assert f"resumed from {self.newest[1]} at step {self.newest[0]} " in output, where
        else:
            assert "resumed from" not in output, where

    def kill_once(self, zygote: Zygote, rng: random.Random, log_prefix) -> str:
        """Start the run, kill it during its 1st or 2nd save; returns the phase the kill hit."""
        start_step = self.newest[0] if self.newest else 0
        target = start_step + rng.randint(1, 2)
        assert target < MAX_STEPS, f"the killed runs got too close to the end\n{self.context()}"
        forked = fork_run(zygote, self.layout, self.args, log_prefix)
        try:
            aimed = kill_during_save(forked, self.root, target, set(self.left), rng, self.context())
        finally:
            forked.close()
        self.history.append(f"kill {len(self.history)}: during the save of step {target}, {aimed}")
        self.check_start(forked.output())
        found = check_disk(self.root, self.newest is not None, self.context())
        phase = phase_of_kill(self.root, found, start_step)
        self.history[-1] += f": {phase}"
        self.newest = found[-1] if found else None
        self.left = tuple(path.name for path in leftovers(self.root))
        return phase


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "mode"), [("single", "sync"), ("single", "async"), ("fsdp2", "sync"),
                                              ("fsdp2", "async")])
def test_random_sigkills_during_saves_never_leave_a_bad_checkpoint(tmp_path, zygote, cache, uninterrupted, layout,
                                                                   mode):
    rng = random.Random(f"{SEED}-{layout}-{mode}")
    run_dir = tmp_path / "run"
    args = overrides(layout, run_dir, cache, save_mode(mode))
    harness = Harness(layout, mode, args, run_dir / "checkpoints", [])
    phases: collections.Counter = collections.Counter()
    # Kill until KILLS_IN_SAVES kills have hit a save: a kill between two saves proves little.
    while len(harness.history) - phases["between saves"] < KILLS_IN_SAVES:
        assert len(harness.history) < 2 * KILLS_IN_SAVES, f"too few kills hit a save: {phases}\n{harness.context()}"
        phases[harness.kill_once(zygote, rng, tmp_path / f"log-{len(harness.history)}")] += 1
    print(f"\n{layout}/{mode}: {len(harness.history)} kills: " + ", ".join(f"{n} {p}" for p, n in phases.items()))
    print("  " + "\n  ".join(harness.history))

    # Started once more, the run finishes as if it had never been interrupted.
    forked = run_forked(zygote, layout, args, tmp_path / "log-final")
    assert forked.exit_codes() == [0] * LAYOUTS[layout][0], forked.output()[-3000:]
    harness.check_start(forked.output())
    final = check_disk(harness.root, True, f"{harness.context()}\nafter the final run")
    assert [step for step, _ in final] == [MAX_STEPS] and read_latest(harness.root) == final[0][1].name
    assert not leftovers(harness.root) and verify_checkpoint(run_dir / "model") == []
    straight = uninterrupted(layout)
    assert counted_metrics(run_dir) == counted_metrics(straight)
    files = sorted(p.relative_to(run_dir).as_posix() for p in [*(run_dir / "model").glob("*.safetensors"),
                                                                *final[0][1].rglob("*.safetensors")])
    assert any("optimizer" in name for name in files)
    for name in files:
        assert (run_dir / name).read_bytes() == (straight / name).read_bytes(), name


# ----- a full disk -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, zygote, cache):
    """Checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    proc = run_single(zygote, overrides("single", run_dir, cache, "train.max_steps=2", "checkpoint.keep_last=2"),
                      run_dir.parent / "log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_stops_the_run_with_one_sentence_and_keeps_earlier_checkpoints(two_checkpoints, tmp_path, zygote,
                                                                                   cache, mode):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    root = run_dir / "checkpoints"
    before = {path.name: path.stat().st_mtime_ns for _, path in committed(root)}
    assert list(before) == ["step-00000001", "step-00000002"]
    assert all(verify_checkpoint(root / name) == [] for name in before)
    # The limit lies between the two big files of a save: model.safetensors still fits,
    # train_state/optimizer.safetensors (Adam's two moments: twice the weights) does not.
    model_bytes = (root / "step-00000002" / "model.safetensors").stat().st_size
    optimizer_bytes = (root / "step-00000002" / "train_state" / "optimizer.safetensors").stat().st_size
    limit = (model_bytes + optimizer_bytes) // 2
    assert model_bytes < limit < optimizer_bytes
    model_manifest = (run_dir / "model" / "manifest.json").read_bytes()
    args = overrides("single", run_dir, cache, "train.max_steps=4", "checkpoint.keep_last=2",
                     save_mode(mode))

    proc = run_single(zygote, args, tmp_path / "log-full", max_file_bytes=limit)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr  # one sentence, said once
    failed = root / "step-00000003.tmp-"
    assert errors[0].startswith("error: checkpoint step 3 was not saved: rank 0 could not write "), errors[0]
    assert f"{failed}" in errors[0] and "/train_state/optimizer.safetensors (File too large)" in errors[0], errors[0]
    assert errors[0].endswith("; free disk space or fix the path (earlier checkpoints are intact)"), errors[0]
    assert f"resumed from {root / 'step-00000002'} at step 2 " in proc.stdout
    # Nothing committed, nothing touched: the failed save removed its partial directory itself.
    assert {path.name: path.stat().st_mtime_ns for _, path in committed(root)} == before
    assert all(verify_checkpoint(root / name) == [] for name in before)
    assert read_latest(root) == "step-00000002" and not leftovers(root)
    assert (run_dir / "model" / "manifest.json").read_bytes() == model_manifest  # the earlier run's, untouched

    proc = run_single(zygote, args, tmp_path / "log-resumed")  # space again: the run picks up where it was
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / 'step-00000002'} at step 2 " in proc.stdout
    assert "leftover" not in proc.stdout  # the failed save had removed its directory
    assert [path.name for _, path in committed(root)] == ["step-00000003", "step-00000004"]
    assert all(verify_checkpoint(path) == [] for _, path in committed(root)) and not leftovers(root)
    assert [row["step"] for row in counted_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_full_disk_at_the_final_model_names_it_and_keeps_the_previous_one(two_checkpoints, tmp_path, zygote, cache):
    """A run whose steps are all done still writes model/ last, through the same commit."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    root, model_dir = run_dir / "checkpoints", run_dir / "model"
    before = {path.name: path.stat().st_mtime_ns for _, path in committed(root)}
    model_manifest = (model_dir / "manifest.json").read_bytes()
    args = overrides("single", run_dir, cache, "train.max_steps=2", "checkpoint.keep_last=2")

    limit = (model_dir / "model.safetensors").stat().st_size // 2  # no step to save: the model file is the first
    proc = run_single(zygote, args, tmp_path / "log-full", max_file_bytes=limit)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr
    assert errors[0].startswith(f"error: the model directory {model_dir} was not saved: rank 0 could not write "
                                f"{run_dir}/model.tmp-"), errors[0]
    assert errors[0].endswith("/model.safetensors (File too large); free disk space or fix the path (earlier "
                              "checkpoints are intact)"), errors[0]
    assert (model_dir / "manifest.json").read_bytes() == model_manifest and verify_checkpoint(model_dir) == []
    assert {path.name: path.stat().st_mtime_ns for _, path in committed(root)} == before
    assert not leftovers(run_dir) and not leftovers(root)

    proc = run_single(zygote, args, tmp_path / "log-resumed")  # space again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / 'step-00000002'} at step 2 " in proc.stdout
    assert verify_checkpoint(model_dir) == [] and not leftovers(run_dir)


@pytest.mark.slow
def test_a_latest_that_cannot_be_written_says_the_checkpoint_was_saved(two_checkpoints, tmp_path, zygote, cache):
    """Once renamed, a checkpoint is committed: a failure to update `latest` must not call it unsaved."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    root = run_dir / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").mkdir()  # renaming the new `latest` over a directory fails
    args = overrides("single", run_dir, cache, "train.max_steps=3", "checkpoint.keep_last=2")

    proc = run_single(zygote, args, tmp_path / "log-refused")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr
    assert errors[0] == (f"error: {root / 'step-00000003'} was saved, but {root / 'latest'} could not be updated "
                         "(Is a directory); free disk space or fix the path (resume=auto finds the newest valid "
                         "checkpoint without it)"), errors[0]
    assert verify_checkpoint(root / "step-00000003") == []

    (root / "latest").rmdir()
    proc = run_single(zygote, args, tmp_path / "log-resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / 'step-00000003'} at step 3 " in proc.stdout


@pytest.fixture(scope="module")
def two_checkpoints_on_two_ranks(tmp_path_factory, zygote, cache):
    """Checkpoints at steps 1 and 2, saved by 2 FSDP2 ranks."""
    run_dir = tmp_path_factory.mktemp("full-fsdp2") / "run"
    args = overrides("fsdp2", run_dir, cache, "train.max_steps=2", "checkpoint.keep_last=2")
    forked = run_forked(zygote, "fsdp2", args, run_dir.parent / "log")
    assert forked.exit_codes() == [0, 0], forked.output()[-3000:]
    return run_dir


def shard_name(rank: int) -> str:
    return f"{rank + 1:05d}-of-00002.safetensors"


def optimizer_file_fails(root: Path, rank: int) -> int:
    """A file-size limit under which `rank` writes its model file but not its optimizer file."""
    model_bytes = (root / "step-00000002" / f"model-{shard_name(rank)}").stat().st_size
    optimizer_bytes = (root / "step-00000002" / "train_state" / f"optimizer-{shard_name(rank)}").stat().st_size
    limit = (model_bytes + optimizer_bytes) // 2
    assert model_bytes < limit < optimizer_bytes
    return limit


def assert_full_disk_sentence_on_every_rank(forked: Forked, root: Path, step: int, failing_rank: int) -> None:
    assert forked.exit_codes() == [2, 2], forked.output()[-3000:]
    for rank, path in enumerate(forked.logs):
        text = path.read_text()
        assert "Traceback" not in text, text[-3000:]
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, text[-3000:]
        prefix = "error: " if rank == 0 else f"[rank {rank}] error: "
        assert errors[0].startswith(f"{prefix}checkpoint step {step} was not saved: rank {failing_rank} could not "
                                    f"write {root}/step-{step:08d}.tmp-"), errors[0]
        assert errors[0].endswith(f"/train_state/optimizer-{shard_name(failing_rank)} (File too large); free disk "
                                  "space or fix the path (earlier checkpoints are intact)"), errors[0]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "failing_rank"), [("sync", 0), ("sync", 1), ("async", 0), ("async", 1)])
def test_a_full_disk_on_one_rank_stops_every_rank_with_the_same_sentence(two_checkpoints_on_two_ranks, tmp_path, zygote,
                                                                         cache, mode, failing_rank):
    """The rank whose write fails still takes part in every transfer: no rank hangs, none commits."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints_on_two_ranks, run_dir)
    root = run_dir / "checkpoints"
    before = {path.name: path.stat().st_mtime_ns for _, path in committed(root)}
    assert list(before) == ["step-00000001", "step-00000002"]
    # Rank r writes model file r+1 and optimizer file r+1; only the latter is too big for the limit.
    limit = optimizer_file_fails(root, failing_rank)
    args = overrides("fsdp2", run_dir, cache, "train.max_steps=4", "checkpoint.keep_last=2", save_mode(mode))

    # A hang here would be a rank waiting for the one that failed.
    forked = run_forked(zygote, "fsdp2", args, tmp_path / "log-full", max_file_bytes={failing_rank: limit})
    assert_full_disk_sentence_on_every_rank(forked, root, 3, failing_rank)
    assert {path.name: path.stat().st_mtime_ns for _, path in committed(root)} == before
    assert all(verify_checkpoint(root / name) == [] for name in before)
    assert read_latest(root) == "step-00000002" and not leftovers(root)

    forked = run_forked(zygote, "fsdp2", args, tmp_path / "log-resumed")  # space again
    assert forked.exit_codes() == [0, 0], forked.output()[-3000:]
    assert f"resumed from {root / 'step-00000002'} at step 2 " in forked.output()
    assert "leftover" not in forked.output()  # the failed save had removed its directory
    assert [path.name for _, path in committed(root)] == ["step-00000003", "step-00000004"]
    assert all(verify_checkpoint(path) == [] for _, path in committed(root)) and not leftovers(root)
    assert [row["step"] for row in counted_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_ranks_that_learn_of_a_failed_async_save_at_different_times_stop_after_the_same_step(
        two_checkpoints_on_two_ranks, tmp_path, zygote, cache):
    """Rank 1 learns 3 s after rank 0 that the step-25 save failed, while both train on towards step 50. A rank
    that raised as soon as it knew would leave the other in its next collective ("Connection closed by peer")."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints_on_two_ranks, run_dir)
    root = run_dir / "checkpoints"
    args = overrides("fsdp2", run_dir, cache, "train.max_steps=50", "checkpoint.every_steps=25",
                     "checkpoint.keep_last=2", save_mode("async"))
    forked = run_forked(zygote, "fsdp2", args, tmp_path / "log", max_file_bytes={0: optimizer_file_fails(root, 0)},
                        late_failure_s={1: 3.0})
    assert_full_disk_sentence_on_every_rank(forked, root, 25, 0)
    assert [path.name for _, path in committed(root)] == ["step-00000001", "step-00000002"] and not leftovers(root)
