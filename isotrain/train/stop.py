"""Graceful stop: SIGTERM or SIGINT asks the run to stop at the next step boundary.

The first signal only sets a flag and notes when it came; the loop checks it after each step on every
rank (one tiny all-reduce, so all ranks stop at the same step; train/run_loop.py), saves a checkpoint and
exits cleanly. A second SIGINT interrupts at once.

checkpoint.preempt_grace_s bounds the wait from the signal to the save's start: a scheduler kills the job some
time after its SIGTERM, and a save begun too late would be cut short (harmlessly: it commits atomically, but
the time is lost and the log says nothing). A step that ends past the grace on any rank stops the run unsaved,
with a sentence; a save that starts in time runs to its end (an async one is waited for), however long.
"""

from __future__ import annotations

import signal
import threading
import time


class GracefulStop:
    def __init__(self):
        self.signal_name: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received_at is None:
            self.received_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name

    @property
    def received(self) -> bool:
        """Whether this rank has received a signal (the loop tells every rank if any has)."""
        return self.signal_name is not None

    def past_grace(self, grace_s: float | None) -> bool:
        """Whether more than `grace_s` seconds (checkpoint.preempt_grace_s; None: no bound) have passed since the
        first signal."""
        return grace_s is not None and self.received_at is not None and time.monotonic() - self.received_at > grace_s
