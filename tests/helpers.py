"""Helpers shared by tests: launching real multi-process runs and tiny model configs."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

# Overrides for a tiny, quiet training run (a few seconds on CPU); tests add what they exercise.
TINY_RUN = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "logging.progress=false",
    "eval.path=null",
]

# The metrics.jsonl fields that must match exactly between equivalent runs (timings excluded).
COUNTED = ("step", "loss", "lr", "grad_norm", "tokens_seen", "trained_tokens", "samples_seen")


def counted_metrics(run_dir) -> list[dict]:
    """metrics.jsonl rows of a run, without the timings."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in COUNTED} for row in rows]


def model_weights(directory) -> dict:
    """Every model tensor of a Hugging Face directory, from its one or several safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(directory).glob("model*.safetensors")):
        tensors.update(load_file(path))
    return tensors


# How long a test waits for a run before calling it hung. Far beyond any run of this suite on a loaded machine
# (the longest takes a few minutes on a quiet one), so only a real hang trips it, never a busy machine.
HANG_S = 1800


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun(nproc: int, args: list[str], timeout: float = HANG_S, **kwargs) -> subprocess.CompletedProcess:
    """Launch `nproc` real processes on this machine with torchrun (gloo on CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = kwargs.pop("env", None) or subprocess_env()
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


_ERROR_LINE = re.compile(r"terminate called|what\(\):|[Aa]bort|Fatal|SIG[A-Z]+|Error|error:|exitcode")


def failure(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed launch's stderr for an assertion message: its last `tail` characters, preceded by every earlier
    line that names an error. With several ranks the first one to fail is often far from the end, behind the
    tracebacks of the ranks it left waiting."""
    head, end = proc.stderr[:-tail], proc.stderr[-tail:]
    lines = [line for line in head.splitlines() if _ERROR_LINE.search(line)]
    if not lines:
        return end
    return "\n".join(["[earlier error lines]", *lines[-60:], "[last lines]", end])


def isotrain_cli(args: list[str], timeout: float = HANG_S, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "isotrain", *args]
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, **kwargs)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it at once, like a node losing power, and wait until every one
    of them has ended: a process goes on holding what it holds (a run directory's lock) until its exit is done,
    which on a loaded machine can come well after the signal."""
    import signal
    import time

    targets = {target: _started(target) for target in [pid, *descendants(pid)]}
    for target in targets:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + HANG_S
    while any(started is not None and _started(target) == started for target, started in targets.items()):
        assert time.monotonic() < deadline, f"processes {list(targets)} outlived SIGKILL"
        time.sleep(0.01)


def _started(pid: int) -> int | None:
    """The start tick of process `pid` (/proc/<pid>/stat field 22), or None once it has ended: gone, or a zombie
    (which only waits for its parent to read its status). Compared with the tick read before, a later process
    given the same pid is not taken for it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def kill_after_commit(cmd: list[str], run_dir, step: int) -> list[Path]:
    """Start `cmd` and SIGKILL every one of its processes as soon as checkpoint `step` is committed.

    Checkpoints committed after it (the kill came a little late) are deleted, so `step` is the
    newest; they are returned."""
    import shutil
    import time

    target = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + HANG_S
    while not target.is_dir():  # a step directory appears only by the commit's rename
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never committed its checkpoint"
        time.sleep(0.002)
    kill_tree(proc.pid)
    proc.wait()
    proc.stderr.close()
    later = [p for p in target.parent.glob("step-*") if p.name > target.name and "." not in p.name]
    for path in later:
        shutil.rmtree(path)
    return later


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_concurrently(jobs: dict, workers: int | None = None) -> dict:
    """Call independent jobs side by side, as many at once as there are CPU cores: {name: job()}.

    Each job launches its own real processes (single-threaded: OMP_NUM_THREADS=1), so a test that
    runs them one after the other leaves the other cores idle. Jobs start in the given order (put
    the longest first); an exception of any job is raised once all of them have ended."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or cpu_count()) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


# The manifest.json that isotrain wrote before BLAKE3 (format version 1), cut to one file: one
# sha256 of each whole file. Checkpoints in this format must keep verifying and resuming.
SHA256_MANIFEST_SAMPLE = {
    "files": {"chat_template.jinja": {"bytes": 250, "sha256": "fd434c668d0e2a6faab5709bcba277844d7f9b1b7e737a34e253f1898a9dee9c"}},
    "format": "isotrain-checkpoint",
    "kind": "checkpoint",
    "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "world_size": 1},
    "step": 2,
    "version": 1,
}


def rewrite_as_sha256_manifest(directory) -> dict:
    """Turn a checkpoint's manifest into the version 1 format of SHA256_MANIFEST_SAMPLE (sha256 of each
    file computed here), written as isotrain wrote it (sorted keys, indent 2); returns it."""
    import hashlib

    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    old = {key: manifest[key] for key in SHA256_MANIFEST_SAMPLE if key != "files"}
    old["version"] = 1
    old["files"] = {name: {"bytes": spec["bytes"],
                           "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest()}
                    for name, spec in manifest["files"].items()}
    assert set(old) == set(SHA256_MANIFEST_SAMPLE)
    assert all(set(spec) == {"bytes", "sha256"} for spec in old["files"].values())
    (directory / "manifest.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    return old


def assert_clean_error(proc, expected: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in " ".join(lines[0].split()), proc.stderr


def assert_error_sentence(proc, sentence: str) -> None:
    """Exit code 2 and exactly `error: <sentence>` on stderr, nothing else."""
    assert_clean_error(proc, sentence)
    assert proc.returncode == 2
    assert " ".join(proc.stderr.split()) == f"error: {sentence}"


def vllm_python() -> str:
    """The interpreter of the vLLM engine environment for the vLLM tests.

    CI (.ci/run) builds the environment with scripts/build_vllm_cpu_env.py and exports ISOTRAIN_VLLM_PYTHON, so
    there the tests always run (a wrong path fails them). A developer run without the variable uses the
    environment the script builds by default (~/.cache/isotrain) if it is already there, and otherwise skips, saying how to build it
    (it is 2.5 GB and minutes of downloads: never built behind a test's back)."""
    import pytest

    python = os.environ.get("ISOTRAIN_VLLM_PYTHON")
    if python:
        return python
    script = REPO / "scripts" / "build_vllm_cpu_env.py"
    # The tests point ISOTRAIN_CACHE at temporary folders (conftest.py): look where the script builds by default.
    env = {k: v for k, v in os.environ.items() if k != "ISOTRAIN_CACHE"}
    found = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, env=env)
    if found.returncode != 0:
        pytest.skip(f"no vLLM engine environment: build it with `python {script.relative_to(REPO)}` (CI does) "
                    "or set ISOTRAIN_VLLM_PYTHON")
    return found.stdout.strip()


def orphaned_vllm_dirs(settle_s: float = 3.0) -> list[Path]:
    """The vLLM engines' temporary directories in /dev/shm that no live engine process holds (its command line names
    the directory) and that stay so for `settle_s`: what a run must never leave behind. Robust to other tests'
    engines running meanwhile, and to one that was just killed and is about to be cleaned up by its owner."""

    def orphans() -> set[Path]:
        held = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    held.append(Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"))
                except OSError:
                    continue
        held_text = "\n".join(held)
        return {d for d in Path("/dev/shm").glob("isotrain-vllm-*") if f"{d}/" not in held_text}

    import time

    found = orphans()
    if found:
        time.sleep(settle_s)
        found &= orphans()
    return sorted(found)
