"""The test harness's forked runs (tests/zygote.py) are tracked from the moment they exist: a run that ends at once,
even before the test has heard of it, is still watched and its exit code read, however loaded the machine is."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import HANG_S, subprocess_env
from zygote import fork_ranks, run_forked_ranks, shared_zygote

REFUSED = ["train", "nosuch.key=1"]  # a config error: the forked run ends within milliseconds


def busy_processes(count: int) -> list[subprocess.Popen]:
    """CPU-bound processes beside the test, as other programs on a shared machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def test_runs_that_end_at_once_are_tracked_under_load():
    busy = busy_processes(2)
    try:
        for _ in range(20):
            proc = run_forked_ranks(1, REFUSED)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert "unknown config key 'nosuch'" in proc.stderr and "Traceback" not in proc.stderr
        with tempfile.TemporaryDirectory() as tmp:  # several ranks of a run, each ending at once
            logs = [Path(tmp) / f"rank{rank}.txt" for rank in range(4)]
            forked = fork_ranks(shared_zygote(), 4, REFUSED, logs)
            forked.finish(HANG_S)
            assert forked.exit_codes() == [2, 2, 2, 2]
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def test_a_run_is_watched_however_long_the_test_takes_to_look(tmp_path):
    """The run has ended (and on a harness that let the kernel reap it at once, vanished) before the test looks."""
    log = tmp_path / "run.txt"
    pidfd = shared_zygote().fork(REFUSED, log, subprocess_env())
    try:
        time.sleep(1.0)  # a test thread descheduled on a busy machine
        ready, _, _ = select.select([pidfd], [], [], 60)
        assert ready
    finally:
        os.close(pidfd)
    assert (tmp_path / "run.txt.exit").read_text() == "2"
    assert "unknown config key 'nosuch'" in log.read_text()


def test_a_worker_script_ends_with_the_exit_code_python_would_give_it(tmp_path):
    """A forked worker runs as `python SCRIPT ARGV` would: as __main__, its folder importable, its argv, and each
    way of ending gives Python's own exit code (os._exit included, which some workers use to skip teardown)."""
    (tmp_path / "sibling.py").write_text("VALUE = 'imported'\n")
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        "from sibling import VALUE\n"
        "if __name__ == '__main__':\n"
        "    print(VALUE, sys.argv[1:])\n"
        "    how = sys.argv[1]\n"
        "    if how == 'os_exit': os._exit(3)\n"
        "    if how == 'sys_exit': sys.exit()\n"
        "    if how == 'message': sys.exit('stopped')\n"
        "    if how == 'raise': raise RuntimeError('boom')\n"
    )
    expected = {"return": 0, "os_exit": 3, "sys_exit": 0, "message": 1, "raise": 1}
    for how, code in expected.items():
        proc = run_forked_ranks(1, [how, "x"], script=script)
        assert proc.returncode == code, (how, proc.stderr[-2000:])
        assert f"imported ['{how}', 'x']" in proc.stdout, (how, proc.stdout)
    assert "RuntimeError: boom" in run_forked_ranks(1, ["raise"], script=script).stderr
