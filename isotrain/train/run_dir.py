"""A run owns its output directory: one run at a time, and never a directory of someone else's files.

The lock is `<output_dir>/.isotrain.lock`, one JSON line naming the process that holds it (pid, host,
start time, and what tells a live process from a dead one: the machine's boot id and the process's
own start tick). It is written in full to a temporary file and then hard-linked to its name: link(2)
fails with EEXIST when the name exists, so creating it has O_CREAT|O_EXCL semantics and a second
run never reads half a lock. The run removes it when it ends, normally or by an error; a SIGKILL
leaves it behind, and the next run on this host sees that its process is gone and takes it over. A
lock from another host cannot be checked from here: the user decides.

A directory isotrain has run in carries a marker, `.isotrain` (naming the first run started there). A
run refuses an existing directory without it unless the directory is empty or holds only what an
isotrain run writes (directories of runs older than the marker): otherwise `output_dir=.` would
write its config.yaml over the user's own, and its checkpoints beside the user's files.

A run of several nodes needs one output_dir that all of them see (a shared file system): every rank writes its
share of a checkpoint there and rank 0 commits them all, and the other nodes read what rank 0 writes (the
tokenizer). Node-local directories of the same path are refused at start-up, before anything is trained
(`check_shared`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from isotrain.errors import ConfigError
from isotrain.parallel.dist import DistInfo, broadcast_from_main, gather_from_all

LOCK = ".isotrain.lock"
MARKER = ".isotrain"
# What a run writes into its output_dir (session.py, recipes/, train/setup.py, train/metrics.py, train/progress.py).
RUN_FILES = {"config.yaml", "metrics.jsonl", "checkpoints", "model", "tokenizer", "engine_tokenizer", "tensorboard",
             "progress", LOCK, MARKER}
# Only these prove that an isotrain run wrote a directory (a config.yaml alone may be the user's own).
RUN_EVIDENCE = ("metrics.jsonl", "checkpoints", "model")
# Leftovers of a write cut short: atomic_write_text's and save's temporaries, this module's own.
_LEFTOVER = re.compile(r"^\.config\.yaml\.tmp-\d+$|^model\.(tmp|old)-[0-9a-z-]+$|^\.isotrain\.lock\.[a-z]+-\d+$"
                       r"|^\.isotrain-shared-[0-9a-f]{32}$")


@contextmanager
def own_output_dir(output_dir: Path, info: DistInfo, log) -> Iterator[Path]:
    """Hold `output_dir` for the run inside the `with`: rank 0 checks and locks it before any file is written.

    Every rank learns rank 0's verdict (a refusal is raised on all of them, so none waits in a collective for
    a rank that has left), then checks that it sees the same directory; the lock is removed when the block ends,
    however it ends."""
    held, refusal = None, None
    if info.is_main:
        try:
            check_foreign_files(output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)
            held = acquire(output_dir / LOCK, log)
            _mark(output_dir, held)
        except ConfigError as err:
            refusal = str(err)
        except OSError as err:  # raised on rank 0 alone, the others would wait for its verdict
            refusal = (f"cannot write into output_dir {output_dir} ({err.strerror or err}); choose a directory this "
                       "user can write")
    refusal = broadcast_from_main(refusal)
    if refusal is not None:
        raise ConfigError(refusal)
    try:
        check_shared(output_dir, info)
        yield output_dir
    finally:
        if held is not None:
            release(output_dir / LOCK, held)


# ----- whose files ------------------------------------------------------------------------------
def check_foreign_files(output_dir: Path) -> None:
    """Refuse an existing directory that holds files no isotrain run wrote."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir {output_dir} is a file; choose a directory path (new or empty) for the run")
    foreign = _foreign_entry(output_dir)
    if foreign is not None:
        raise ConfigError(f"output_dir {output_dir} holds files that isotrain did not write (e.g. {foreign}); "
                          "choose a new or empty output_dir, or move those files away")


def _foreign_entry(directory: Path, depth: int = 0) -> str | None:
    """The name of one entry of `directory` that is not a run's, or None when it is a run directory (or empty)."""
    if not directory.is_dir() or (directory / MARKER).is_file():
        return None
    names = sorted(os.listdir(directory), key=lambda name: (name.startswith("."), name))  # a visible one is named
    for name in names:
        if name in RUN_FILES or _LEFTOVER.match(name):
            continue
        # A run directory inside (the bundled RL recipe trains its SFT start in <output_dir>/sft) is a run's too.
        if depth == 0 and (directory / name).is_dir() and _foreign_entry(directory / name, 1) is None:
            continue
        return name
    if "config.yaml" in names and not any(name in names for name in RUN_EVIDENCE):
        return "config.yaml"
    if depth > 0 and not any(name in names for name in RUN_EVIDENCE):
        return directory.name  # an empty or config-only subdirectory is not a run of ours
    return None


def _mark(output_dir: Path, record: str) -> None:
    """The directory is an isotrain run directory from now on; the marker names the first run started there.
    Written once: a later run that is refused (e.g. by a damaged checkpoint) leaves the directory as it was."""
    if (output_dir / MARKER).is_file():
        return
    with open(output_dir / MARKER, "a") as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())


# ----- one directory for every node ----------------------------------------------------------------
SHARED_PROBE = ".isotrain-shared-"  # + a random hex name: the file of `check_shared`


def check_shared(output_dir: Path, info: DistInfo) -> None:
    """Refuse an output_dir that is not one directory for every rank (node-local disks, no shared file system).

    Rank 0 writes a file of a new random name holding a random token, then sends the name (a broadcast, so no
    rank looks before the file is there); every rank reads it back, and one all-gather tells every rank who
    could not. The name is new, so no machine answers from what it cached of an earlier look-up. Rank 0 removes
    the file at once (and the file of a check that a SIGKILL cut short: it holds the run's lock)."""
    if not info.is_distributed:
        return
    token, problem = None, None
    if info.is_main:
        token = uuid.uuid4().hex
        try:
            for stale in output_dir.glob(f"{SHARED_PROBE}*"):
                stale.unlink(missing_ok=True)
            (output_dir / f"{SHARED_PROBE}{token}").write_text(token)
        except OSError as err:
            problem = (f"cannot write into output_dir {output_dir} ({err.strerror or err}); choose a directory this "
                       "user can write")
    token, problem = broadcast_from_main((token, problem))
    if problem is not None:
        raise ConfigError(problem)
    probe = output_dir / f"{SHARED_PROBE}{token}"
    views = gather_from_all((_reads(probe) == token, socket.gethostname()))
    if info.is_main:
        probe.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (seen, host) in enumerate(views) if not seen]
    if blind:
        who = _ranks_on_hosts(blind)  # e.g. "ranks 8-15 on host b"
        raise ConfigError(f"output_dir {output_dir} is not one directory that every node sees: the file rank 0 "
                          f"wrote into it is not there for {who}; all nodes must see the same output_dir, so put it "
                          "on a file system that every node mounts at the same path")


def _reads(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # missing here, or the directory itself is
        return None


def _ranks_on_hosts(ranks_hosts: list[tuple[int, str]]) -> str:
    """`ranks 2-3 on host b` / `ranks 8-15 on host b, 16-23 on host c` (the first four hosts)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in ranks_hosts:
        by_host.setdefault(host, []).append(rank)
    parts = [f"{_spans(ranks)} on host {host}" for host, ranks in by_host.items()]
    if len(parts) > 4:
        parts = [*parts[:4], f"more on {len(parts) - 4} other hosts"]
    return f"{'rank' if len(ranks_hosts) == 1 else 'ranks'} {', '.join(parts)}"


def _spans(ranks: list[int]) -> str:
    """[1, 3, 4, 5] -> `1, 3-5`."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


# ----- the lock -----------------------------------------------------------------------------------
def acquire(lock: Path, log) -> str:
    """Create `lock` for this process, taking over a stale one; returns the text written."""
    record = _record()
    for _ in range(3):  # a takeover races another run starting at the same moment at most a few times
        if _create(lock, record):
            return record
        try:
            held_text = lock.read_text()
        except FileNotFoundError:  # released between our attempt and this read
            continue
        held = _parse(lock, held_text)
        _refuse_if_live(lock, held)
        if _remove_if_unchanged(lock, held_text):
            log(f"[yellow]taking over {lock}: the run that held it (pid {held['pid']} on {held['host']}, started "
                f"{held['started']}) is no longer running[/]")
    raise ConfigError(f"other runs are starting in {lock.parent} at this moment; let one of them run, or choose "
                      "another output_dir")


def release(lock: Path, record: str) -> None:
    """Remove `lock` if it is still the one this process wrote."""
    try:
        if lock.read_text() == record:
            lock.unlink()
    except FileNotFoundError:
        pass


def _record() -> str:
    return json.dumps({
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "boot_id": _boot_id(),
        "pid_start": _process_start(os.getpid()),
    }) + "\n"


def _create(lock: Path, record: str) -> bool:
    """Give `lock` the content `record` in one step unless it exists (link(2): O_CREAT|O_EXCL, whole)."""
    tmp = lock.with_name(f"{lock.name}.new-{os.getpid()}")
    tmp.write_text(record)
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _parse(lock: Path, text: str) -> dict:
    try:
        held = json.loads(text)
        return {key: held[key] for key in ("pid", "host", "started", "boot_id", "pid_start")}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{lock} is not a lock that isotrain wrote; delete it if no run is using {lock.parent}, "
                          "and run again") from None


def _refuse_if_live(lock: Path, held: dict) -> None:
    where = f"pid {held['pid']} on {held['host']}, started {held['started']}"
    if held["host"] != socket.gethostname():
        raise ConfigError(f"output_dir {lock.parent} is locked by a run on host {held['host']} (pid {held['pid']}, "
                          f"started {held['started']}); choose another output_dir, or delete {lock} if that run is gone")
    if _running(held):
        raise ConfigError(f"output_dir {lock.parent} is in use by another run ({where}); choose another output_dir, "
                          "or wait until that run ends")


def _running(held: dict) -> bool:
    """Whether the process named by a lock of this host still runs (not a later process given the same pid)."""
    if held["boot_id"] is not None and held["boot_id"] != _boot_id():
        return False  # the machine has restarted since
    if Path("/proc/self/stat").is_file():
        start = _process_start(held["pid"])
        return start is not None and (held["pid_start"] is None or start == held["pid_start"])
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # a zombie has ended


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _remove_if_unchanged(lock: Path, held_text: str) -> bool:
    """Remove a stale lock, unless another run took it over first (then its fresh lock is put back)."""
    aside = lock.with_name(f"{lock.name}.stale-{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if aside.read_text() == held_text:
        aside.unlink()
        return True
    try:
        os.link(aside, lock)  # not ours to remove; a third run may have created a lock meanwhile
    except FileExistsError:
        pass
    aside.unlink()
    return False
