"""One run of any recipe (SFT, RL, embedding training), top to bottom.

    start    the process group; the layout (parallel/dims.py); Hub ids' config and tokenizer files fetched once
             per machine (models/loading.py); the recipe's sizes and early checks: every size checked, every small
             input read, before any work (invariant 7); then a Hub model's weights
    own      the run directory, locked until the run ends (train/run_dir.py); sizes and placement printed;
             every RNG seeded; the DeviceMesh
    build    the recipe's tokenizer, data, model(s) and optimizer(s) on that mesh (`Recipe.build`)
    resume   the checkpoint manager, told what the recipe saves beside its model and what a resume must
             match; leftovers of an interrupted save removed; resume -> RunState
    run      config.yaml written (only now: a refused run leaves the previous one's as it was); the
             recipe's start; `run_loop` over the recipe's step and evaluation; metrics.jsonl; each rank's
             progress file (train/progress.py), which names a rank that hangs
    end      stopped by a signal: the stop message, the checkpoint is the result (no final model/);
             otherwise the final model/ and the recipe's finish; the process group goes, then the
             recipe's work that must run without one (`Recipe.after_shutdown`)

A recipe supplies only what is its own: its sizes and checks, what it builds, its step, its evaluation
and the state it saves beside the model. Adding a recipe, or a parallel axis, touches this file once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from isotrain.checkpoint.files import atomic_write_text
from isotrain.checkpoint.manager import MODEL_DIR, SFT_COUNTERS, CheckpointContract, CheckpointManager, Resumed
from isotrain.config import RunConfig, dump_config
from isotrain.data.cache import tokenizer_fingerprint
from isotrain.data.sources import fetch_hub_data
from isotrain.models.loading import fetch_run_files
from isotrain.parallel.dims import ParallelDims, resolve_dims, restart_count
from isotrain.parallel.dist import DistInfo, barrier, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import ParallelState, build_parallel
from isotrain.parallel.tp import check_replicated
from isotrain.train.metrics import MetricsWriter, last_logged_step
from isotrain.train.progress import Progress
from isotrain.train.run_dir import own_output_dir
from isotrain.train.run_loop import LoopSettings, RunState, run_loop, stopped_message
from isotrain.train.schedule import schedule_settings
from isotrain.train.setup import seed_everything


@dataclass
class RunResult:
    """What a run of any recipe reports."""

    output_dir: Path
    model_dir: Path | None  # None when stopped early
    step: int
    counters: dict[str, int]  # exact sums over all ranks (tokens_seen, trained_tokens, samples_seen, ...)
    final_loss: float  # of the last step
    stopped: bool = False  # stopped early by SIGTERM/SIGINT
    eval_before: object = None  # the recipe's held-out evaluation before training, if it has one
    eval_after: object = None  # ... and of the final model
    model: object = None  # the trained module itself, single-process runs only
    data_stats: object = None  # the dataset's own totals, where the recipe has them (SFT's DataStats)


@dataclass
class Session:
    """What every recipe builds on: the config, where this process stands, the sizes, the run directory."""

    cfg: RunConfig
    info: DistInfo
    console: Console
    degrees: ParallelDims
    plan: object  # the recipe's batch plan (sizes.py)
    log: Callable[..., None] = print  # prints on rank 0 only (rank_log)
    output_dir: Path | None = None  # set once the run owns it
    parallel: ParallelState | None = None  # the mesh, built after the run directory
    checkpoints: CheckpointManager | None = None  # set after `Recipe.build`, before the first step


class Recipe:
    """What a recipe adds to the session. A subclass is made with (cfg, degrees), where it computes its
    batch plan and refuses what it cannot run; `build` then sets tokenizer, model and optimizer."""

    counter_keys: tuple[str, ...] = SFT_COUNTERS  # the exact sums a checkpoint saves with the step
    batch_field = "train.global_batch_size"  # the setting behind the sampler's batch size, named in errors
    eval_every = 0  # evaluate every this many steps (0: the recipe's start and finish only)

    plan: object
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    eval_before: object = None
    eval_after: object = None

    def build(self, session: Session) -> None:
        raise NotImplementedError

    def extra_state(self) -> dict:
        """What a checkpoint records beside the session's own (schedule, tokenizer) and a resume must match:
        the sampler's state and the data's fingerprint at least."""
        raise NotImplementedError

    def components(self) -> tuple:
        """Other trained models of the run as (prefix, model, optimizer), e.g. PPO's critic."""
        return ()

    def static_files(self) -> dict[str, bytes]:
        """Files every checkpoint and the final model carry beside the Hugging Face ones (rank 0)."""
        return {}

    def check_resumed(self, resumed: Resumed | None) -> None:
        """Refuse a resume the recipe cannot continue (called before any step); read back what its `state_files`
        saved in the checkpoint (`resumed.path`)."""

    def state_files(self) -> dict[str, bytes]:
        """Files of the recipe's own state that a checkpoint saved now must hold (see CheckpointContract)."""
        return {}

    def start(self, state: RunState) -> dict | None:
        """Before the first step; fields returned are written as a metrics row at the current step."""
        return None

    def step(self, state: RunState) -> dict:
        """Runs step `state.step`, adds to state.counters, returns its metrics row (run_loop's StepFn)."""
        raise NotImplementedError

    def evaluate(self, step: int) -> dict:
        """Every `eval_every` steps: fields added to that step's metrics row."""
        return {}

    def finish(self, state: RunState, model_dir: Path) -> dict | None:
        """After the final model is saved; fields returned are written as a metrics row at the last step."""
        return None

    def close(self) -> None:
        """Release what the recipe holds (an engine process), however the run ends."""

    def loading_hint(self, model_dir: Path) -> str:
        """How to load the final model, for the closing line."""
        return ""

    def after_shutdown(self, result: RunResult) -> None:
        """On every process once the process group is gone (work that must not run inside one)."""


def run_session(cfg: RunConfig, make_recipe, console: Console | None = None) -> RunResult:
    """Run the recipe `make_recipe(cfg, degrees)` from start to its final model (or a stop signal)."""
    info = init_distributed(cfg.parallel.timeout_s)
    console = console or Console(stderr=False)
    recipe = None
    try:
        with ExitStack() as scope:  # the run's hold on output_dir, released however the run ends
            degrees = resolve_dims(cfg.parallel, info.world_size)
            # Hub ids: the small files the checks read, then (every check passed) the weights, once per machine.
            fetch_run_files(cfg, "config", info.local_rank)
            recipe = make_recipe(cfg, degrees)  # every size and early check, before any work
            fetch_run_files(cfg, "weights", info.local_rank)
            fetch_hub_data(_data_paths(cfg), info.local_rank)
            session = Session(cfg, info, console, degrees, recipe.plan, rank_log(info, console))
            _own(session, scope)
            try:
                result = _run(session, recipe)
            finally:
                recipe.close()
    finally:
        shutdown_distributed()
    recipe.after_shutdown(result)
    return result


def _own(session: Session, scope: ExitStack) -> None:
    """The run directory (checked and locked until `scope` closes, before any file is written), the printed
    sizes and placement, every RNG seeded, then the mesh."""
    cfg, info = session.cfg, session.info
    session.output_dir = scope.enter_context(own_output_dir(Path(cfg.output_dir), info, session.log))
    if info.is_main:
        session.console.print(plan_table(session.plan, session.degrees))
        session.log(placement_line(info, session.degrees))
    barrier()
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    session.parallel = build_parallel(session.degrees, info.device, info.rank, info.timeout_s)


def _run(session: Session, recipe: Recipe) -> RunResult:
    cfg, info = session.cfg, session.info
    recipe.build(session)
    checkpoints = session.checkpoints = _checkpoint_manager(session, recipe)
    checkpoints.clean_leftovers()
    resumed = checkpoints.resume()
    recipe.check_resumed(resumed)
    state = RunState(0, {key: 0 for key in recipe.counter_keys})
    if resumed is not None and not resumed.weights_only:
        state = RunState(resumed.step, dict(resumed.counters))
    if restart_count() > 0 and info.is_main:  # read before MetricsWriter drops the rows after the checkpoint
        session.log(restart_line(state.step, last_logged_step(session.output_dir / "metrics.jsonl")))
    if info.is_main:  # only now: a run refused above leaves the previous run's config.yaml as it was
        atomic_write_text(session.output_dir / "config.yaml", dump_config(cfg))
    writer = MetricsWriter(session.output_dir, info.is_main, cfg.logging.tensorboard, start_step=state.step)
    model_dir = None
    try:
        _write_row(writer, state.step, recipe.start(state))
        settings = LoopSettings(cfg.train.max_steps, cfg.train.log_every, cfg.logging.progress, recipe.eval_every,
                                cfg.checkpoint.preempt_grace_s)
        progress = Progress(session.output_dir, info.rank, info.world_size, checkpoints.run_id, info.timeout_s)
        run_loop(settings, info, state, recipe.step, checkpoints, writer, session.console, recipe.evaluate,
                 after_first_step=lambda: check_replicated(recipe.model, session.parallel.tp_group), progress=progress)
        if state.stopped_by is None:
            model_dir = checkpoints.save_model(session.output_dir / MODEL_DIR)
            _write_row(writer, state.step, recipe.finish(state, model_dir))
    finally:
        writer.close()
    if state.stopped_by is not None:
        # Preemption leaves little time: no final model/ (the checkpoint is itself a Hugging Face model
        # directory) and no evaluation, just the resumable checkpoint.
        session.log(stopped_message(state.stopped_by, state.step, checkpoints.root))
    else:
        if cfg.checkpoint.every_steps > 0:
            session.log(f"checkpoints in {checkpoints.root} (the loop waited {checkpoints.blocked_s:.2f} s on saves)")
        session.log(f"wrote {session.output_dir}: config.yaml, metrics.jsonl ({state.step} steps), model/"
                    + recipe.loading_hint(model_dir))
    return RunResult(session.output_dir, model_dir, state.step, state.counters, state.loss,
                     stopped=state.stopped_by is not None, eval_before=recipe.eval_before,
                     eval_after=recipe.eval_after,
                     model=recipe.model if not info.is_distributed and state.stopped_by is None else None,
                     data_stats=getattr(recipe, "data_stats", None))


def restart_line(step: int, last_logged: int | None) -> str:
    """What a start that torchrun restarted (--max-restarts) says: which restart, where it resumes, what is redone."""
    count = f"restart {restart_count()} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}"
    where = f"resuming at step {step}" if step > 0 else "no checkpoint to resume from, starting at step 0"
    if last_logged is not None and last_logged > step:
        redone = f"steps {step + 1}-{last_logged} of the failed start are run again"
    else:
        redone = "the failed start had logged no step after it"
    return f"[yellow]torchrun restarted this job after a worker failed ({count}): {where}; {redone}[/]"


def _write_row(writer: MetricsWriter, step: int, fields: dict | None) -> None:
    if fields:
        writer.write({"step": step, **fields})


def _checkpoint_manager(session: Session, recipe: Recipe) -> CheckpointManager:
    """The checkpoint manager, told what the recipe counts, what else it trains and what a resume must match:
    the recipe's sampler and data, and for every recipe the schedule and the tokenizer."""
    cfg, info = session.cfg, session.info
    contract = CheckpointContract(
        extra_state={**recipe.extra_state(), "schedule": schedule_settings(cfg.train),
                     "tokenizer_sha256": tokenizer_fingerprint(recipe.tokenizer)},
        counter_keys=recipe.counter_keys,
        batch_field=recipe.batch_field,
        components=recipe.components(),
        state_files=recipe.state_files,
    )
    layout = {"world_size": info.world_size, **dict(session.degrees.as_rows())}
    checkpoints = CheckpointManager(cfg, info.rank, info.world_size, layout, recipe.model, recipe.optimizer,
                                    recipe.tokenizer, contract, session.log)
    if info.is_main:
        checkpoints.static.update(recipe.static_files())
    return checkpoints


def placement_line(info: DistInfo, degrees: ParallelDims) -> str:
    """Where the run computes: the device, the process group's backend, and whether FSDP2 shards the model."""
    import torch.distributed as dist

    device = str(info.device)
    if info.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(info.device)})"
    if dist.is_initialized():
        count = f"{info.world_size} process" + ("es" if info.world_size > 1 else "")
        group = f"process group: {dist.get_backend()}, {count}"
    else:
        group = "one process, no process group"
    sharded = f"; FSDP2 over {degrees.dp_shard * degrees.cp} rank(s)" if degrees.fsdp else ""  # dp_shard × cp
    return f"device: {device}; {group}{sharded}"


def plan_table(plan, degrees: ParallelDims):
    from rich.table import Table

    table = Table(title="batch sizes", show_header=False)
    for name, value in [*degrees.as_rows(), *plan.as_rows()]:
        table.add_row(name, str(value))
    return table


def rank_log(info: DistInfo, console: Console):
    """`log` of a process: prints on rank 0 only; soft_wrap keeps paths whole in a terminal and a log file alike."""
    return functools.partial(console.print, soft_wrap=True) if info.is_main else (lambda *a, **k: None)


def _data_paths(cfg: RunConfig) -> dict[str, str | None]:
    """The run's data paths by config name (data.path, each data.sources[i].path, eval.path): Hub datasets among
    them are fetched before the recipe reads them."""
    paths = {"data.path": cfg.data.path, "eval.path": getattr(getattr(cfg, "eval", None), "path", None)}
    for i, source in enumerate(getattr(cfg.data, "sources", None) or []):
        paths[f"data.sources[{i}].path"] = source.path
    return paths
