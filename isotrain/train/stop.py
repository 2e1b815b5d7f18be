"""Graceful stop: SIGTERM or SIGINT asks the run to stop at the next step boundary.

The first signal only sets a flag; the loop checks it after each step on every rank (one tiny
all-reduce, so all ranks stop at the same step; train/run_loop.py), saves a checkpoint and exits
cleanly. A second SIGINT interrupts at once.
"""

from __future__ import annotations

import signal
import threading


class GracefulStop:
    def __init__(self):
        self.signal_name: str | None = None
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
        self.signal_name = signal.Signals(signum).name

    @property
    def received(self) -> bool:
        """Whether this rank has received a signal (the loop tells every rank if any has)."""
        return self.signal_name is not None
