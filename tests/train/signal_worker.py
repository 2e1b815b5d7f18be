"""`isotrain ARGV` in a rank that signals itself at a chosen step: the start-up hook of the hang and preemption
tests (tests/train/test_hang.py, tests/train/test_preempt.py), run by the zygote as `python signal_worker.py ARGV`.

Set in the environment:
    ISOTRAIN_TEST_SIGNAL         the signal's name, e.g. SIGSTOP (this rank hangs there) or SIGTERM (preemption)
    ISOTRAIN_TEST_SIGNAL_STEP    the step (1-based) at whose start the signal is sent
    ISOTRAIN_TEST_SIGNAL_RANKS   the ranks that send it to themselves, e.g. "1" or "0,1"
    ISOTRAIN_TEST_SIGNAL_HOLD_S  optional: the step then lasts at least this many seconds more (a step that ends
                                 after a preemption's grace, whatever the machine's speed)

The signal comes from the run's own progress (the step it is about to run), never from a test that must catch
the run in time. Every recipe runs its steps through `run_loop`, so wrapping its step function covers SFT, RL
and embedding training alike.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import isotrain.cli
import isotrain.session


def _hooked(step_fn, signum: int, at_step: int, hold_s: float):
    def step(state):
        if state.step + 1 == at_step:
            os.kill(os.getpid(), signum)  # SIGSTOP: the process stops here, before the step's first collective
            time.sleep(hold_s)
        return step_fn(state)
    return step


def main() -> None:
    signum = signal.Signals[os.environ["ISOTRAIN_TEST_SIGNAL"]]
    at_step = int(os.environ["ISOTRAIN_TEST_SIGNAL_STEP"])
    ranks = {int(r) for r in os.environ["ISOTRAIN_TEST_SIGNAL_RANKS"].split(",")}
    hold_s = float(os.environ.get("ISOTRAIN_TEST_SIGNAL_HOLD_S", "0"))
    if int(os.environ.get("RANK", "0")) in ranks:
        original = isotrain.session.run_loop

        def run_loop(settings, info, state, step_fn, *args, **kwargs):
            return original(settings, info, state, _hooked(step_fn, signum, at_step, hold_s), *args, **kwargs)

        isotrain.session.run_loop = run_loop
    isotrain.cli.main(sys.argv[1:])


if __name__ == "__main__":
    main()
