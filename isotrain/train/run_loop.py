"""The step loop every recipe runs (SFT, RL, later embedding training), top to bottom.

    for each step from the resumed one up to train.max_steps:
        row = step_fn(state)          the recipe's step: batch -> loss -> update; adds to state.counters
        evaluation every `eval_every` steps (not after the last: the recipe evaluates its final model)
        a metrics row every train.log_every steps and after the last step; the progress bar
        this rank's progress file: the step done (train/progress.py)
        a stop signal on any rank -> save a checkpoint (even with checkpoint.every_steps=0), end after this step;
            unless the step ended past checkpoint.preempt_grace_s after the signal on any rank: stop unsaved, say so
        an async save that failed on any rank -> every rank raises its error after this same step
        a refused step (TrainingError: a non-finite loss, ...) -> let the last save finish, stop with the step named
        otherwise save when the checkpoint manager says one is due
    a collective that a peer never joined (parallel.timeout_s) -> stop with the step and the silent rank(s) named

Recipes differ only in what a step does; when to log, evaluate, save and stop is decided here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

from isotrain.checkpoint.layout import committed, step_dir_name
from isotrain.errors import IsotrainError, TrainingError
from isotrain.parallel.dist import any_rank, failed_collective
from isotrain.train.metrics import ProgressBar
from isotrain.train.progress import Progress
from isotrain.train.stop import GracefulStop


@dataclass
class RunState:
    """Where a run is: its step and counters (what a checkpoint saves beside the tensors), how it ended."""

    step: int = 0  # steps done: optimizer steps for SFT, RL steps (a rollout and its updates) for RL
    counters: dict[str, int] = field(default_factory=dict)  # exact sums over all ranks, e.g. tokens_seen
    loss: float = float("nan")  # of the last step
    stopped_by: str | None = None  # the signal that ended the run early, if one did


@dataclass(frozen=True)
class LoopSettings:
    """The loop's part of the config: train.max_steps, train.log_every, logging.progress, the recipe's eval_every."""

    max_steps: int
    log_every: int = 1
    progress: bool = True
    eval_every: int = 0  # 0: no evaluation inside the loop
    preempt_grace_s: float | None = None  # checkpoint.preempt_grace_s: a stop's step must end this soon to be saved


# Runs step number `state.step` (0-based), adds to `state.counters` and returns the step's metrics row
# without "step"; the row holds at least "loss" and "tokens_per_s" (shown by the progress bar).
StepFn = Callable[[RunState], dict]
# Evaluates after `step` steps; its fields are added to that step's metrics row.
EvaluateFn = Callable[[int], dict]


def run_loop(settings: LoopSettings, info, state: RunState, step_fn: StepFn, checkpoints, writer, console,
             evaluate: EvaluateFn | None = None, after_first_step: Callable[[], None] | None = None,
             progress: Progress | None = None) -> RunState:
    """Steps state.step .. train.max_steps - 1; returns `state`, with `stopped_by` set if a signal ended it early.

    `checkpoints` is the run's CheckpointManager: it decides whether a save is due; the loop waits for the
    last (asynchronous) save before returning. `after_first_step` runs once, after this run's first step
    (the tensor-parallel replica check). `progress`: this rank's progress file, and how a silent peer is named."""
    max_steps, eval_every = settings.max_steps, settings.eval_every
    first_step = state.step
    enabled = info.is_main and settings.progress
    if progress is not None:
        progress.start(state.step)
    with _set_up_objects_frozen(), GracefulStop() as stop, ProgressBar(max_steps, enabled, console, state.step) as bar:
        try:
            while state.step < max_steps:
                if progress is not None:
                    progress.begin(state.step + 1)
                try:
                    row = step_fn(state)
                except TrainingError as err:
                    # Every rank refuses the same step (its values are global); the previous checkpoint commits.
                    checkpoints.wait()
                    raise TrainingError(f"step {state.step + 1}: {err}") from None
                if after_first_step is not None and state.step == first_step:
                    after_first_step()
                state.step += 1
                state.loss = row["loss"]
                row = {"step": state.step, **row}
                if evaluate is not None and eval_every and state.step % eval_every == 0 and state.step < max_steps:
                    row.update(evaluate(state.step))
                if state.step % settings.log_every == 0 or state.step == max_steps:
                    writer.write(row)
                bar.update(state.step, row["loss"], row["tokens_per_s"])
                if progress is not None:
                    progress.done(state.step)
                if _boundary(settings, info, state, stop, checkpoints):
                    break
        except RuntimeError as err:
            failure = failed_collective(err)
            if failure is None or progress is None:
                raise
            _stop_for_silent_ranks(progress, failure, checkpoints, stop)
    checkpoints.wait()
    if progress is not None:
        progress.end(f"stopped by {state.stopped_by}" if state.stopped_by else "finished")
    return state


def _boundary(settings: LoopSettings, info, state: RunState, stop: GracefulStop, checkpoints) -> bool:
    """After step `state.step`: agree on a stop or a failed background save, save if one is due; True to end."""
    # Every rank learns of a signal, of a stop too late to save, or of a failed background save, on any rank
    # here, so all stop (and save, or raise the save's error) after the same step.
    stopping, save_failed, too_late = any_rank(info.device, stop.received, checkpoints.failed,
                                               stop.past_grace(settings.preempt_grace_s))
    if save_failed:
        checkpoints.raise_failure(state.step)
    if stopping and too_late:
        checkpoints.wait()
        raise IsotrainError(late_stop_message(stop.signal_name or "a signal on another rank", state.step,
                                              settings.preempt_grace_s, checkpoints.root))
    checkpoints.maybe_save(state.step, state.counters, stopping)
    if stopping:
        state.stopped_by = stop.signal_name or "a signal on another rank"
    return stopping


def _stop_for_silent_ranks(progress: Progress, failure: str, checkpoints, stop: GracefulStop) -> None:
    """A collective that a peer never joined: name the silent rank(s) and stop. A background save in flight
    cannot commit without them; its own error (the same failed collective) is not what the user needs to read,
    and it never touches a committed checkpoint."""
    silent = progress.silent_ranks(failure, lambda: stop.received)
    try:
        checkpoints.wait()
    except (IsotrainError, RuntimeError):
        pass
    raise IsotrainError(progress.hang_message(silent, failure)) from None


def late_stop_message(signal_name: str, step: int, grace_s: float, checkpoints_root) -> str:
    """What a stop says when step `step` ended too long after the signal to begin a save."""
    saved = committed(checkpoints_root)
    resume = (f"the next run resumes from {saved[-1][1]}" if saved else
              "there is no checkpoint to resume from, the next run starts at step 0")
    return (f"{signal_name} received, but step {step} ended more than checkpoint.preempt_grace_s={grace_s:g} s "
            f"later: stopped without saving (the scheduler's kill could cut a save short); {resume}; raise "
            "checkpoint.preempt_grace_s or have the scheduler signal earlier (Slurm: --signal=TERM@SECONDS)")


@contextlib.contextmanager
def _set_up_objects_frozen():
    """Keep Python's full garbage collections out of the steps. Such a collection walks every object the process
    holds: with torch and transformers imported, about 250 ms each on 2 CPU cores, landing in whichever step
    allocates at the wrong moment (twice in a 40-step run of bench/train_throughput.py: a 4 % swing of that
    tool's 10-step rate). What exists when the loop starts (modules, model, data) lives for the whole run, so
    it is frozen; later collections see only the objects created since. No collection first: it would cost
    every run (and every test) that 250 ms, and the few cycles left from the set-up are collected after the
    loop, once unfrozen."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def stopped_message(signal_name: str, step: int, checkpoints_root) -> str:
    """What a run stopped by a signal says: where its work is, and that running again resumes it."""
    checkpoint = checkpoints_root / step_dir_name(step)
    return (f"{signal_name} received: stopped after step {step}; checkpoint {checkpoint} saved (a Hugging Face model "
            "directory; no final model/ is written); run again to resume")
