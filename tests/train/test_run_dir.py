"""A run owns its output_dir (isotrain/train/run_dir.py), with real `isotrain` processes (forked from the zygote,
tests/zygote.py: each its own pid, lock and signals): a second run into a directory in use is refused, a lock left
by a killed run is taken over, a directory of someone else's files is refused and left as it was, and the lock goes
away however a run ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import HANG_S, TINY_RUN
from zygote import fork_ranks, run_forked_ranks, run_isotrain, shared_zygote
from isotrain.checkpoint.manifest import verify_checkpoint

TINY = [*TINY_RUN, "train.log_every=1", "checkpoint.every_steps=5"]


def lock_of(run_dir: Path) -> dict:
    return json.loads((run_dir / ".isotrain.lock").read_text())


def assert_refused(proc: subprocess.CompletedProcess, sentence: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == f"error: {sentence}", proc.stderr[-3000:]  # one line, no traceback


def wait_for(predicate, forked, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert forked.running(), f"the run ended before {what}: {forked.output()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_second_run_into_a_directory_in_use_is_refused_and_the_first_finishes_intact(tmp_path):
    run_dir = tmp_path / "run"
    first = fork_ranks(shared_zygote(), 1, ["train", *TINY, "train.max_steps=10", f"output_dir={run_dir}"],
                       [tmp_path / "first.out"], errs=[tmp_path / "first.err"])
    try:
        pid = first.pid(0)
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.read_text(), first, "its first step")
        # Hold the first run mid-training (a real process, merely paused) while the second one starts.
        signal.pidfd_send_signal(first.pidfds[0], signal.SIGSTOP)
        try:
            held = lock_of(run_dir)
            second = run_isotrain(["train", *TINY, "train.max_steps=10", f"output_dir={run_dir}"])
        finally:
            signal.pidfd_send_signal(first.pidfds[0], signal.SIGCONT)
        first.wait(HANG_S)
    finally:
        first.close()  # kills it if a check above failed
    assert (held["pid"], held["host"]) == (pid, socket.gethostname())
    assert_refused(second, f"output_dir {run_dir} is in use by another run (pid {pid} on "
                           f"{socket.gethostname()}, started {held['started']}); choose another output_dir, or wait "
                           "until that run ends")
    assert first.exit_codes() == [0], (tmp_path / "first.err").read_text()[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 11))  # every row once, none torn
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000005", "step-00000010"]
    assert verify_checkpoint(run_dir / "checkpoints" / "step-00000010") == []
    assert (run_dir / "model" / "config.json").is_file()
    assert not (run_dir / ".isotrain.lock").exists()  # released at the end


def dead_process() -> tuple[int, int]:
    """The pid and start tick of a process of this host that has ended (a run SIGKILLed, as far as a lock can tell)."""
    proc = subprocess.Popen(["sleep", "60"])
    start = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    proc.kill()
    proc.wait()
    return proc.pid, start


def test_a_lock_left_by_a_dead_run_of_this_host_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid, start = dead_process()
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (run_dir / ".isotrain.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                        "started": "2026-01-02 03:04:05 UTC", "boot_id": boot_id,
                                                        "pid_start": start}) + "\n")
    proc = run_isotrain(["train", *TINY, "train.max_steps=2", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"taking over {run_dir / '.isotrain.lock'}: the run that held it (pid {pid} on {socket.gethostname()}, "
            "started 2026-01-02 03:04:05 UTC) is no longer running") in proc.stdout
    assert not (run_dir / ".isotrain.lock").exists()
    assert (run_dir / "model" / "config.json").is_file()


def test_a_lock_of_another_host_is_refused_and_kept(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".isotrain.lock"
    text = json.dumps({"pid": 4242, "host": "node-17.cluster", "started": "2026-01-02 03:04:05 UTC",
                       "boot_id": "another-machine", "pid_start": 1}) + "\n"
    lock.write_text(text)
    proc = run_isotrain(["train", *TINY, "train.max_steps=2", f"output_dir={run_dir}"])
    assert_refused(proc, f"output_dir {run_dir} is locked by a run on host node-17.cluster (pid 4242, started "
                         f"2026-01-02 03:04:05 UTC); choose another output_dir, or delete {lock} if that run is gone")
    assert lock.read_text() == text
    assert sorted(os.listdir(run_dir)) == [".isotrain.lock"]  # nothing written


def test_a_directory_of_the_users_own_files_is_refused_and_left_as_it_was(tmp_path):
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("my: own settings\n")
    proc = run_isotrain(["train", *TINY, "train.max_steps=2", f"output_dir={run_dir}"])
    assert_refused(proc, f"output_dir {run_dir} holds files that isotrain did not write (e.g. config.yaml); "
                         "choose a new or empty output_dir, or move those files away")
    assert (run_dir / "config.yaml").read_text() == "my: own settings\n"
    assert sorted(os.listdir(run_dir)) == ["config.yaml"]


def test_output_dir_dot_in_a_folder_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "config.yaml").write_text("my: own settings\n")
    proc = run_isotrain(["train", *TINY, "output_dir=."], cwd=tmp_path)
    assert_refused(proc, "output_dir . holds files that isotrain did not write (e.g. notes.txt); choose a new or "
                         "empty output_dir, or move those files away")
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "notes.txt"]


def test_the_lock_is_released_when_a_run_ends_by_an_error_and_the_directory_stays_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_isotrain(["train", *TINY, f"data.path={tmp_path / 'missing.jsonl'}", f"output_dir={run_dir}"])
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / ".isotrain.lock").exists()
    history = [json.loads(line) for line in (run_dir / ".isotrain").read_text().splitlines()]
    assert [entry["host"] for entry in history] == [socket.gethostname()]
    proc = run_isotrain(["train", *TINY, "train.max_steps=1", f"output_dir={run_dir}"])  # its own directory again
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Written once, by the first run: a later run (refused or not) leaves it as it was.
    assert [json.loads(line) for line in (run_dir / ".isotrain").read_text().splitlines()] == history


def test_a_run_directory_written_before_the_marker_is_still_accepted(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_isotrain(["train", *TINY, "train.max_steps=1", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir / ".isotrain").unlink()  # as an older isotrain left it: config.yaml, metrics.jsonl, checkpoints/, ...
    proc = run_isotrain(["train", *TINY, "train.max_steps=2", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout


@pytest.mark.slow
def test_every_rank_gets_the_refusal_and_none_hangs(tmp_path):
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    (run_dir / "data.csv").write_text("a,b\n")
    proc = run_forked_ranks(2, ["train", *TINY, "parallel.dp_replicate=2", f"output_dir={run_dir}"],
                    timeout=HANG_S)
    sentence = (f"output_dir {run_dir} holds files that isotrain did not write (e.g. data.csv); choose a new or empty "
                "output_dir, or move those files away")
    assert proc.returncode != 0
    assert f"\nerror: {sentence}" in "\n" + proc.stderr and f"[rank 1] error: {sentence}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr.split("error:")[0]
    assert sorted(os.listdir(run_dir)) == ["data.csv"]


def test_the_bundled_rl_recipes_directory_with_its_sft_start_inside_is_a_run_directory(tmp_path):
    from isotrain.errors import ConfigError
    from isotrain.train.run_dir import check_foreign_files

    # `isotrain rl` trains (or finds) its start in runs/rl-default/sft, then runs in runs/rl-default.
    rl_dir = tmp_path / "rl-default"
    (rl_dir / "sft" / "model").mkdir(parents=True)
    (rl_dir / "sft" / "model" / "config.json").write_text("{}")
    check_foreign_files(rl_dir)  # a run's model directory inside: accepted
    (rl_dir / "sft" / "model").rename(rl_dir / "sft" / "weights")  # not what a run writes
    with pytest.raises(ConfigError) as refused:
        check_foreign_files(rl_dir)
    assert str(refused.value) == (f"output_dir {rl_dir} holds files that isotrain did not write (e.g. sft); choose a "
                                  "new or empty output_dir, or move those files away")
