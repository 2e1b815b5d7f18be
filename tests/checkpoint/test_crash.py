"""Crash safety with real kills and a real full disk.

A run that saves at every step (keep_last=1) is SIGKILLed again and again at random instants, most
of them in the middle of a save, and restarted each time with `checkpoint.resume=auto`. After every
kill, every committed checkpoint verifies, `latest` names one of them, and there is always one once
the first was committed; each restart resumes from the newest. The run finally completes with the
same bytes as a run that was never interrupted. A file-size limit (RLIMIT_FSIZE) stands in for a
full disk: the save fails with one sentence, and the earlier checkpoints stay valid.
"""

from __future__ import annotations

import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, kill_tree, subprocess_env
from isotrain.checkpoint.layout import committed, leftovers, read_latest
from isotrain.checkpoint.manifest import verify_checkpoint

TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.deterministic=true",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=1",
    "logging.progress=false",
    "eval.path=null",
]
MAX_STEPS = 24
LAYOUTS = {"single": (1, []), "fsdp2": (2, ["parallel.dp_replicate=1", "parallel.dp_shard=2"])}


def command(layout: str, run_dir, *extra: str) -> list[str]:
    nproc, overrides = LAYOUTS[layout]
    args = ["-m", "isotrain", "train", *TINY, *overrides, f"train.max_steps={MAX_STEPS}", f"output_dir={run_dir}",
            *extra]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300, **kwargs)


def check_disk(root, ever_committed: bool, context: str) -> list[tuple[int, object]]:
    """The invariants that must hold at any instant: returns the committed checkpoints."""
    found = committed(root)
    for _, path in found:
        assert verify_checkpoint(path) == [], f"{context}: committed {path.name} does not verify"
    if ever_committed:
        assert found, f"{context}: no committed checkpoint is left (keep_last=1)"
    latest = read_latest(root)
    if latest is not None:
        assert latest in {path.name for _, path in found}, f"{context}: latest names {latest}, not committed"
    return found


def kill_during_save(cmd, root, log_path, rng: random.Random) -> tuple[bool, str]:
    """Start the run, wait until it has begun its k-th save (k random), kill it after a random delay.

    Returns whether the kill left a save unfinished, and what the run printed.
    """
    saves_to_see, delay = rng.randint(1, 3), rng.uniform(0, 0.015)
    old = {p.name for p in leftovers(root)}  # the previous kill's; this run's saves have a new run id
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)
    seen: set[str] = set()
    deadline = time.monotonic() + 240
    while len(seen) < saves_to_see:
        if proc.poll() is not None:  # finished (or failed) before the kill
            return False, log_path.read_text()
        assert time.monotonic() < deadline, "the run never started saving"
        seen.update(p.name for p in leftovers(root) if ".tmp-" in p.name and p.name not in old)
        time.sleep(0.001)
    time.sleep(delay)
    kill_tree(proc.pid)
    proc.wait()
    interrupted = any(".tmp-" in p.name for p in leftovers(root))
    return interrupted, log_path.read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A reference run per layout, never killed."""
    made = {}

    def get(layout: str):
        if layout not in made:
            run_dir = tmp_path_factory.mktemp(f"straight-{layout}") / "run"
            proc = run(command(layout, run_dir))
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[layout] = run_dir
        return made[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "mode", "kills"),
                         [("single", "sync", 8), ("single", "async", 8), ("fsdp2", "sync", 7), ("fsdp2", "async", 7)])
def test_random_sigkills_during_saves_never_leave_a_bad_checkpoint(tmp_path, uninterrupted, layout, mode, kills):
    rng = random.Random(f"{layout}-{mode}")
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    cmd = command(layout, run_dir, f"checkpoint.async={'true' if mode == 'async' else 'false'}")
    ever_committed, newest, interrupted_saves = False, None, 0
    for kill in range(kills):
        context = f"{layout}/{mode} kill {kill}"
        interrupted, output = kill_during_save(cmd, root, tmp_path / f"log-{kill}.txt", rng)
        if newest is not None:  # the restart resumed from the newest committed checkpoint of the previous kill
            assert f"resumed from {root / newest}" in output, f"{context}: {output[-2000:]}"
        interrupted_saves += interrupted
        found = check_disk(root, ever_committed, context)
        ever_committed = ever_committed or bool(found)
        newest = found[-1][1].name if found else None
        if interrupted:  # what the kill left is reported and cleaned by the next start
            left = [p.name for p in leftovers(root)]
            assert left, context
    print(f"{layout}/{mode}: {interrupted_saves} of {kills} kills interrupted a save")
    # Many kills must land inside a save, or this test would prove little.
    assert interrupted_saves >= kills // 3, f"only {interrupted_saves} of {kills} kills interrupted a save"

    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not leftovers(root)
    final = check_disk(root, True, f"{layout}/{mode} final")
    assert [step for step, _ in final] == [MAX_STEPS]
    # Exact resume through every kill: the same bytes as a run that was never interrupted.
    straight = uninterrupted(layout)
    for name in sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "model").glob("*.safetensors")):
        assert (run_dir / name).read_bytes() == (straight / name).read_bytes(), name
    ours = final[0][1] / "train_state"
    for path in sorted(ours.glob("optimizer*.safetensors")):
        theirs = straight / "checkpoints" / final[0][1].name / "train_state" / path.name
        assert path.read_bytes() == theirs.read_bytes(), path.name


def limit_file_size(num_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, num_bytes))

    return apply


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints at steps 1 and 2, and the run's tokenized data in a cache of its own."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    proc = run(command("single", run_dir, "train.max_steps=2", "checkpoint.keep_last=2",
                       f"data.cache_dir={run_dir / 'cache'}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_stops_the_run_with_one_sentence_and_keeps_earlier_checkpoints(two_checkpoints, tmp_path, mode):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    root = run_dir / "checkpoints"
    before = {path.name: verify_checkpoint(path) for _, path in committed(root)}
    assert before == {"step-00000001": [], "step-00000002": []}
    optimizer_bytes = (root / "step-00000002" / "train_state" / "optimizer.safetensors").stat().st_size
    cmd = command("single", run_dir, "train.max_steps=4", "checkpoint.keep_last=2", f"data.cache_dir={run_dir / 'cache'}",
                  f"checkpoint.async={'true' if mode == 'async' else 'false'}")

    # Every file but the optimizer state fits: step 3's save fails halfway through its files.
    proc = run(cmd, preexec_fn=limit_file_size(optimizer_bytes // 2))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: checkpoint step 3 was not saved: ") and "earlier checkpoints are intact" in message
    assert "train_state/optimizer.safetensors (File too large)" in message, message
    assert {path.name: verify_checkpoint(path) for _, path in committed(root)} == before
    assert read_latest(root) == "step-00000002"

    proc = run(cmd)  # space again: the run picks up where it was
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / 'step-00000002'} at step 2" in proc.stdout
    assert [path.name for _, path in committed(root)] == ["step-00000003", "step-00000004"]
    assert all(verify_checkpoint(path) == [] for _, path in committed(root)) and not leftovers(root)
