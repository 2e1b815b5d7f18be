"""Runs forked from one process that has imported isotrain, torch and transformers.

Importing them takes seconds (about 7 s of CPU on the 2-core CI machine), more than a tiny run itself. A
zygote process pays that once and forks each rank of a run on request, with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT): real processes, real gloo collectives, real files, real signals, only without
the start-up. A rank runs `isotrain ARGV`, or a test's worker script as `python SCRIPT ARGV` would.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import HANG_S, REPO, free_port, subprocess_env

ZYGOTE = r"""
import json, os, resource, runpy, signal, sys, traceback
import isotrain.cli, isotrain.recipes.embed, isotrain.recipes.rl, isotrain.recipes.sft  # the seconds of start-up, paid once
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # else imported by every run

# Runs are not reaped the moment they end: a run that fails at once stays a zombie until the test holds a pidfd of
# it (opened before the test asks for its next run), so no run can vanish, or its pid be reused, before it is watched.
def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

for line in sys.stdin:
    reap()
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        exit_now = os._exit

        def finish(code):  # record the exit code (a killed run leaves none), end without the teardown
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                with open(job["log"] + ".exit", "w") as f:
                    f.write(str(code))
            finally:
                exit_now(code)

        os._exit = finish  # a worker script may end itself that way
        try:
            os.setsid()  # like torchrun's workers: a session of its own
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            null, log = os.open(os.devnull, os.O_RDONLY), os.open(job["log"], flags)
            err = os.open(job["err"], flags) if job["err"] else log
            for source, target in ((null, 0), (log, 1), (err, 2)):
                os.dup2(source, target)
            for fd in {null, log, err}:
                os.close(fd)
            os.environ.clear()
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            if job["max_file_bytes"] is not None:  # a full disk: writes past it fail with EFBIG
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (job["max_file_bytes"],) * 2)
            if job["late_failure_s"]:  # this rank's background save takes that long to report a failure
                import time
                from isotrain.checkpoint.manager import CheckpointManager
                in_background = CheckpointManager._in_background
                def slowly(function):
                    def run(*args):
                        try:
                            function(*args)
                        except BaseException:
                            time.sleep(job["late_failure_s"])
                            raise
                    return run
                CheckpointManager._in_background = lambda self, function, *args: in_background(
                    self, slowly(function), *args)
            try:
                if job["script"]:  # as `python SCRIPT ARGV`: its folder first on sys.path, run as __main__
                    sys.argv = [job["script"], *job["argv"]]
                    sys.path.insert(0, os.path.dirname(job["script"]))
                    runpy.run_path(job["script"], run_name="__main__")
                else:
                    isotrain.cli.main(job["argv"])
                code = 0
            except SystemExit as done:  # as Python ends: None is 0, a message is 1
                code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            finish(code)
    print(pid, flush=True)
"""


class Zygote:
    """A Python process that imported isotrain, torch and transformers once and forks a run on request."""

    def __init__(self, log_path):
        self.log_path = log_path
        self.lock = threading.Lock()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=subprocess_env(), cwd=REPO, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)

    def fork(self, argv: list[str], log_path, env: dict, max_file_bytes: int | None = None,
             late_failure_s: float = 0.0, err_path=None, cwd=REPO, script=None) -> int:
        """Start one process running `isotrain argv` (or `python script argv`); its output goes to `log_path`
        (stderr to `err_path` if given) and its exit code to `log_path` + ".exit". Returns a pidfd of it, which
        the caller closes."""
        job = {"argv": argv, "log": str(log_path), "env": env, "cwd": str(cwd), "max_file_bytes": max_file_bytes,
               "late_failure_s": late_failure_s, "err": str(err_path) if err_path else None,
               "script": str(script) if script else None}
        with self.lock:  # one request at a time (tests start runs from threads); the zygote reaps only at the next
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            assert reply, f"the zygote died: {self.log_path.read_text()[-3000:]}"
            return os.pidfd_open(int(reply))  # running or a zombie, never reaped yet: this is the run

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=HANG_S)


@dataclass
class Forked:
    """The rank processes of one run, watched and killed through pidfds (no pid can be reused under us; a rank
    that has ended stays readable on its pidfd)."""

    pidfds: list[int]
    logs: list

    def running(self) -> bool:
        ready, _, _ = select.select(self.pidfds, [], [], 0)
        return len(ready) < len(self.pidfds)

    def kill(self) -> None:
        """SIGKILL every rank at once, like a node losing power."""
        for fd in self.pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:  # this rank had already ended
                pass
        self.wait(HANG_S)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for fd in self.pidfds:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"a rank did not end within {timeout} s"

    def pid(self, rank: int) -> int:
        """The process id of a rank (to find its children; signal it through its pidfd)."""
        with open(f"/proc/self/fdinfo/{self.pidfds[rank]}") as info:
            return next(int(line.split()[1]) for line in info if line.startswith("Pid:"))

    def wait_rank(self, rank: int, timeout: float) -> None:
        ready, _, _ = select.select([self.pidfds[rank]], [], [], timeout)
        assert ready, f"rank {rank} did not end within {timeout} s"

    def finish(self, timeout: float) -> None:
        """Wait for every rank to end (a hang fails the test), then release the pidfds either way."""
        try:
            self.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.running():
            self.kill()
        for fd in self.pidfds:
            os.close(fd)

    def output(self) -> str:
        return "\n".join(path.read_text() for path in self.logs if path.exists())

    def exit_codes(self) -> list[int | None]:
        """Each rank's exit status; None for a rank that was killed."""
        files = [path.with_name(path.name + ".exit") for path in self.logs]
        return [int(path.read_text()) if path.exists() else None for path in files]


def fork_ranks(zygote: Zygote, nproc: int, argv: list[str], logs: list[Path], max_file_bytes: dict | None = None,
               late_failure_s: dict | None = None, errs: list[Path] | None = None, cwd=REPO, script=None,
               env: dict | None = None) -> Forked:
    """Start the `nproc` ranks of `isotrain argv` (or of `python script argv`), rank r writing to logs[r] (and its
    stderr to errs[r], if given). `max_file_bytes` maps a rank to the largest file it can write, `late_failure_s`
    to how long its background saves wait before they report a failure; `env` replaces `subprocess_env()`; `cwd`
    is every rank's working directory, or a list of one per rank (e.g. a directory per "node")."""
    env, port = dict(env) if env else subprocess_env(), free_port()
    pidfds = []
    for rank in range(nproc):
        rank_env = dict(env)
        if nproc > 1:  # what torchrun gives each worker
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        limit = (max_file_bytes or {}).get(rank)
        late = (late_failure_s or {}).get(rank, 0.0)
        err = errs[rank] if errs else None
        rank_cwd = cwd[rank] if isinstance(cwd, (list, tuple)) else cwd
        pidfds.append(zygote.fork(argv, logs[rank], rank_env, limit, late, err, rank_cwd, script))
    return Forked(pidfds, logs)


_shared: list[Zygote] = []
_shared_lock = threading.Lock()


def shared_zygote() -> Zygote:
    """This process's zygote, started on first use and closed at exit."""
    with _shared_lock:
        if not _shared:
            directory = tempfile.mkdtemp(prefix="isotrain-zygote-")
            _shared.append(Zygote(Path(directory) / "log.txt"))
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            atexit.register(_shared[0].close)  # atexit runs last-registered first: close, then remove
        return _shared[0]


# Rank 0 could not listen on MASTER_PORT: another program took the port after free_port() found it free. The run
# failed in its rendezvous, before it wrote anything, so it is started again on another port.
PORT_TAKEN = "EADDRINUSE"


def run_forked_ranks(nproc: int, argv: list[str], timeout: float = HANG_S, cwd=REPO,
                     script=None) -> subprocess.CompletedProcess:
    """`isotrain argv` (or `python script argv`, a test's worker) on `nproc` forked ranks, waited for, as one
    finished process: every rank's stdout, then every rank's stderr, in rank order, and the first non-zero exit
    code. What torchrun itself does (its rendezvous, restarts, killing the other ranks when one fails) is tested
    with `helpers.torchrun`."""
    for _ in range(3):
        proc = _run_forked_once(nproc, argv, timeout, cwd, script)
        if nproc == 1 or proc.returncode == 0 or PORT_TAKEN not in proc.stderr:
            break
    return proc


def run_isotrain(argv: list[str], timeout: float = HANG_S, cwd=REPO) -> subprocess.CompletedProcess:
    """`isotrain argv` on one forked process, as `python -m isotrain argv` would run it."""
    return run_forked_ranks(1, argv, timeout, cwd)


def _run_forked_once(nproc: int, argv: list[str], timeout: float, cwd, script) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="isotrain-run-") as tmp:
        logs = [Path(tmp) / f"rank{rank}.out" for rank in range(nproc)]
        errs = [Path(tmp) / f"rank{rank}.err" for rank in range(nproc)]
        forked = fork_ranks(shared_zygote(), nproc, argv, logs, errs=errs, cwd=cwd, script=script)
        forked.finish(timeout)
        codes = forked.exit_codes()
        stdout, stderr = ("".join(path.read_text() for path in paths if path.exists()) for paths in (logs, errs))
    code = next((c if c is not None else -signal.SIGKILL for c in codes if c != 0), 0)
    return subprocess.CompletedProcess([str(script) if script else "isotrain", *argv], code, stdout, stderr)


def kill_forked_after_commit(nproc: int, argv: list[str], run_dir, step: int, cwd=REPO) -> list[Path]:
    """`isotrain argv` on `nproc` forked ranks, every rank SIGKILLed at once as soon as checkpoint `step` is
    committed (helpers.kill_after_commit does the same to an ordinary launch, paying its start-up).

    Checkpoints committed after it (the kill came a little late) are deleted, so `step` is the newest; they are
    returned."""
    target = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="isotrain-killed-") as tmp:
            logs = [Path(tmp) / f"rank{rank}.txt" for rank in range(nproc)]
            forked = fork_ranks(shared_zygote(), nproc, argv, logs, cwd=cwd)
            try:
                deadline = time.monotonic() + HANG_S
                while not target.is_dir() and forked.running():  # a step directory appears only by the rename
                    assert time.monotonic() < deadline, "the run never committed its checkpoint"
                    time.sleep(0.002)
                if target.is_dir():
                    forked.kill()
                    break
                forked.wait(HANG_S)
                output = forked.output()
            finally:
                forked.close()
        # It ended before the commit: only a port taken in the rendezvous (nothing written yet) is tried again.
        assert nproc > 1 and PORT_TAKEN in output, output[-3000:]
    else:
        raise AssertionError(f"the rendezvous port was taken 3 times: {output[-3000:]}")
    later = [p for p in target.parent.glob("step-*") if p.name > target.name and "." not in p.name]
    for path in later:
        shutil.rmtree(path)
    return later
