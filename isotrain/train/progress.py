"""Per-rank progress files: how far each rank got, so that the ranks still alive can name the one that went silent.

    <output_dir>/progress/rank-00001.json   {"rank": 1, "host": "node7", "pid": 4242, "run": "3f2a...",
                                             "step": 4, "state": "running", "time": "2026-11-27T11:52:35"}

Each rank rewrites its own file at the start of the loop, after every step (`step`: steps done) and when the
loop ends (`state`: "running", "finished", "stopped by SIGTERM", "stopped in step 5: a collective timed out").
The write is a small file and a rename, no fsync: a hint for people and for the other ranks, never state that a
resume reads. `run` is the run's id (CheckpointManager.run_id): a file left by an earlier run is not taken for
this run's.

When a collective of step k times out (parallel.timeout_s), the ranks still alive each write "stopped in step k",
then read the others' files for a while: a rank whose file does not say it stopped too is one that did not
arrive, and the sentence names it with the last step its file records.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

PROGRESS_DIR = "progress"
# How long the ranks still alive wait for each other's files once a collective failed: a survivor learns of the
# failure when its own wait times out, or at once when a peer that timed out first closes its connection.
REPORT_WAIT_CAP_S = 60.0


def progress_path(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / PROGRESS_DIR / f"rank-{rank:05d}.json"


class Progress:
    """This rank's progress file, and what the other ranks' files say."""

    def __init__(self, output_dir: Path, rank: int, world_size: int, run_id: str, timeout_s: float | None):
        self.output_dir, self.rank, self.world_size, self.run_id = Path(output_dir), rank, world_size, run_id
        self.timeout_s = timeout_s
        self.step_done = 0
        self.current_step = 1  # the step whose work, or whose boundary (log, evaluate, save), is in progress
        self._record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "run": run_id}

    def start(self, step_done: int) -> None:
        progress_path(self.output_dir, 0).parent.mkdir(parents=True, exist_ok=True)
        self.step_done, self.current_step = step_done, step_done + 1
        self._write("running")

    def done(self, step: int) -> None:
        """After step `step`: its boundary (log, evaluate, save) is still counted as step `step`."""
        self.step_done = step
        self._write("running")

    def begin(self, step: int) -> None:
        self.current_step = step

    def end(self, state: str) -> None:
        self._write(state)

    def _write(self, state: str) -> None:
        record = {**self._record, "step": self.step_done, "state": state,
                  "time": datetime.now().isoformat(timespec="seconds")}
        path = progress_path(self.output_dir, self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)

    def read(self, rank: int) -> dict | None:
        """Rank `rank`'s record of this run; None if it wrote none."""
        try:
            record = json.loads(progress_path(self.output_dir, rank).read_text())
        except (OSError, ValueError):  # not written yet, or replaced as it was read
            return None
        return record if record.get("run") == self.run_id else None

    def silent_ranks(self, failure: str, signalled: Callable[[], bool] = lambda: False) -> dict[int, dict | None]:
        """After a failed collective: report this rank's stop, then wait (up to parallel.timeout_s, at most
        REPORT_WAIT_CAP_S) for every other rank to report its own; those that do not are returned with their
        last record. A signal (`signalled()`: SIGTERM, Ctrl-C) ends the wait at once: it is torchrun (or a
        scheduler) stopping the job because a peer died, and it kills a worker that stays past its grace, which
        would hold a restart up that long."""
        self.end(f"stopped in step {self.current_step}: a collective {failure}")
        wait_s = min(self.timeout_s or REPORT_WAIT_CAP_S, REPORT_WAIT_CAP_S)
        deadline = time.monotonic() + wait_s
        while True:
            records = {rank: self.read(rank) for rank in range(self.world_size) if rank != self.rank}
            silent = {rank: record for rank, record in records.items()
                      if record is None or record["state"] == "running"}
            if not silent or time.monotonic() >= deadline or signalled():
                return silent
            time.sleep(0.2)

    def hang_message(self, silent: dict[int, dict | None], failure: str) -> str:
        """The one sentence of the ranks that stop because a collective timed out or failed."""
        step = self.current_step
        if not silent:
            return (f"step {step}: a collective {failure} although every rank reached it (each one's progress file "
                    f"in {self.output_dir / PROGRESS_DIR} says so); committed checkpoints are intact; check the "
                    "network between the ranks, then run again to resume")
        ranks = sorted(silent)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        seen = ("its " if len(ranks) == 1 else "") + "; ".join(
            _last_seen(self.output_dir, rank, silent[rank]) for rank in ranks)
        return (f"step {step}: {who} did not arrive at a collective within parallel.timeout_s={self.timeout_s:g} s "
                f"({seen}); committed checkpoints are intact; find out why that rank stopped (a hung process, a dead "
                "node or network link), or raise parallel.timeout_s if its work legitimately takes longer, then run "
                "again to resume")


def _last_seen(output_dir: Path, rank: int, record: dict | None) -> str:
    path = progress_path(output_dir, rank)
    if record is None:
        return f"progress file {path} holds nothing of this run"
    return f"progress file {path} last says step {record['step']} done"
