"""The pre-training / SFT loop, top to bottom.

set up (sizes checked first) -> for each step: this rank's micro-batches of global batch k ->
train_step -> counters and metrics -> checkpoint when due -> save the final model -> exact-match evaluation.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from isotrain.checkpoint.files import atomic_write_text
from isotrain.checkpoint.layout import step_dir_name
from isotrain.checkpoint.manager import MODEL_DIR, CheckpointManager
from isotrain.config import Config, dump_config
from isotrain.data.cache import tokenizer_fingerprint
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import read_rows
from isotrain.models.loading import check_layout_fits, count_parameters
from isotrain.parallel.dist import DistInfo, init_distributed, shutdown_distributed
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.mesh import build_parallel
from isotrain.parallel.tp import check_replicated
from isotrain.sizes import plan_batches
from isotrain.train.evaluate import exact_match
from isotrain.train.metrics import MetricsWriter, ProgressBar, flops_per_token, peak_tflops
from isotrain.train.schedule import lr_at
from isotrain.train.setup import prepare_data, prepare_model, prepare_tokenizer, start_run
from isotrain.train.step import step_options, train_step
from isotrain.train.stop import GracefulStop


@dataclass
class Counters:
    step: int = 0
    tokens_seen: int = 0
    trained_tokens: int = 0
    samples_seen: int = 0

    def as_dict(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "trained_tokens": self.trained_tokens,
                "samples_seen": self.samples_seen}


@dataclass
class TrainResult:
    output_dir: Path
    model_dir: Path | None  # None when stopped early
    counters: Counters
    final_loss: float
    accuracy: float | None
    model: object = None  # the trained module itself, single-process runs only
    data_stats: object = None  # the dataset's own totals (DataStats)
    stopped: bool = False  # stopped early by SIGTERM/SIGINT


def _metrics_row(cfg, counters: Counters, result, lr: float, step_s: float, flops_tok: float, peak) -> dict:
    tokens_per_s = result.num_input_tokens / step_s
    row = {
        "step": counters.step,
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens_seen": counters.tokens_seen,
        "trained_tokens": counters.trained_tokens,
        "samples_seen": counters.samples_seen,
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
    }
    if peak is not None:
        row["mfu"] = tokens_per_s * flops_tok / (peak * 1e12)
    return row


@dataclass
class Run:
    """What the step loop works on, built once by `_train`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: object
    sampler: GlobalBatchSampler
    checkpoints: CheckpointManager
    parallel: object  # ParallelState


def _checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every_steps
    return every > 0 and (step % every == 0 or step == cfg.train.max_steps)


def run_steps(cfg, info, plan, run: Run, pad_id, writer, console, counters: Counters) -> tuple[float, str | None]:
    """Steps counters.step .. max_steps - 1; saves checkpoints when due and stops early on SIGTERM/SIGINT.

    Returns the last loss and the name of the signal that stopped the run early, if any."""
    options = step_options(cfg, run.parallel)
    first_step = counters.step
    base = getattr(run.model, "module", run.model).config
    world_peak = peak_tflops(cfg.train.peak_tflops, info.device)
    world_peak = world_peak * info.world_size if world_peak else None
    num_params = count_parameters(run.model)
    loss = float("nan")
    enabled = info.is_main and cfg.logging.progress
    with GracefulStop() as stop, ProgressBar(cfg.train.max_steps, enabled, console, counters.step) as bar:
        for step in range(counters.step, cfg.train.max_steps):
            index_lists = run.sampler.micro_batches(step, run.parallel.dp_rank, plan.dp_size, plan.micro_batch_size)
            micro_batches = [collate([run.dataset[i] for i in indices], pad_id) for indices in index_lists]
            lr = lr_at(step, lr=cfg.train.lr, schedule=cfg.train.schedule, warmup_steps=cfg.train.warmup_steps,
                       max_steps=cfg.train.max_steps, min_lr_ratio=cfg.train.min_lr_ratio)
            start = time.perf_counter()
            result = train_step(run.model, run.optimizer, micro_batches, lr, options, info.device,
                                before_update=run.checkpoints.before_update)
            step_s = time.perf_counter() - start
            if step == first_step:  # a missing TP gradient reduction shows as replicas that drifted apart
                check_replicated(run.model, run.parallel.tp_group)
            counters.step = step + 1
            counters.tokens_seen += result.num_input_tokens
            counters.trained_tokens += result.num_trained_tokens
            counters.samples_seen += result.num_samples
            loss = result.loss
            mean_len = result.num_input_tokens / max(result.num_samples, 1)
            flops_tok = flops_per_token(num_params, base.num_hidden_layers, base.hidden_size, mean_len)
            if counters.step % cfg.train.log_every == 0 or counters.step == cfg.train.max_steps:
                writer.write(_metrics_row(cfg, counters, result, lr, step_s, flops_tok, world_peak))
            bar.update(counters.step, loss, result.num_input_tokens / step_s)
            stopping = stop.requested(info.device)
            if _checkpoint_due(cfg, counters.step) or (stopping and cfg.checkpoint.every_steps > 0):
                run.checkpoints.save(counters.step, counters.as_dict())
            if stopping:
                return loss, stop.signal_name or "a signal on another rank"
    return loss, None


def _evaluate(cfg: Config, model, tokenizer, console) -> float | None:
    rows = read_rows(cfg.eval.path, "prompt_completion").rows[: cfg.eval.max_samples]
    accuracy = exact_match(model, tokenizer, rows, cfg.eval.max_new_tokens)
    console.print(f"exact-match accuracy on {len(rows)} held-out prompts: {accuracy:.1%}")
    return accuracy


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    info = init_distributed()
    console = console or Console(stderr=False)
    try:
        result, tokenizer = _train(cfg, info, console)
    finally:
        shutdown_distributed()
    if info.is_main and cfg.eval.path is not None and not result.stopped:
        # Several processes: evaluate the saved directory once the process group is gone
        # (from_pretrained on one rank inside a group can hang in transformers 5).
        model = result.model if result.model is not None else _load_saved(result.model_dir)
        result.accuracy = _evaluate(cfg, model, tokenizer, console)
    return result


def _load_saved(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own output says what was loaded
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _resume_counters(resumed) -> Counters:
    if resumed is None or resumed.weights_only:
        return Counters()
    return Counters(step=resumed.step, **resumed.counters)


def _train(cfg: Config, info: DistInfo, console: Console) -> tuple[TrainResult, object]:
    # soft_wrap: a line names paths whole, in a terminal and in a log file alike
    log = functools.partial(console.print, soft_wrap=True) if info.is_main else (lambda *a, **k: None)
    degrees = resolve_dims(cfg.parallel, info.world_size)
    plan = plan_batches(cfg, degrees)  # invariant 7: every size checked before any work
    check_layout_fits(cfg.model, degrees)
    output_dir = start_run(cfg, info, console, plan, degrees)
    tokenizer = prepare_tokenizer(cfg, info, output_dir, log)
    dataset = prepare_data(cfg, info, tokenizer, log)
    parallel = build_parallel(degrees, info.device, info.rank)
    model, optimizer = prepare_model(cfg, info, tokenizer, parallel)
    log(f"model: {count_parameters(model):,} parameters; data: {len(dataset)} samples, "
        f"{dataset.stats.total_input_tokens:,} tokens, {dataset.stats.total_trained_tokens:,} trained")
    sampler = GlobalBatchSampler(len(dataset), plan.global_batch_size, cfg.train.seed)
    layout = {"world_size": info.world_size, **dict(degrees.as_rows())}
    checkpoints = CheckpointManager(cfg, info.rank, info.world_size, layout, model, optimizer, tokenizer, log)
    checkpoints.extra_state = {
        "sampler": sampler.state_dict(),
        "schedule": {k: getattr(cfg.train, k) for k in ("lr", "schedule", "warmup_steps", "max_steps", "min_lr_ratio")},
        "data_fingerprint": Path(dataset.cache_path).name if dataset.cache_path else None,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    }
    checkpoints.clean_leftovers()
    counters = _resume_counters(checkpoints.resume())
    if info.is_main:  # only now: a run refused above leaves the previous run's config.yaml as it was
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))
    run = Run(model, optimizer, dataset, sampler, checkpoints, parallel)
    writer = MetricsWriter(output_dir, info.is_main, cfg.logging.tensorboard, start_step=counters.step)
    try:
        loss, stopped_by = run_steps(cfg, info, plan, run, tokenizer.pad_token_id, writer, console, counters)
        checkpoints.wait()
    finally:
        writer.close()
    if stopped_by is not None:
        # Preemption leaves little time: no final model and no evaluation, just a resumable checkpoint.
        saved = f"checkpoint {checkpoints.root / step_dir_name(counters.step)} saved; run again to resume" \
            if cfg.checkpoint.every_steps > 0 else "no checkpoint saved (checkpoint.every_steps=0)"
        log(f"{stopped_by} received: stopped after step {counters.step}; {saved}")
        return TrainResult(output_dir, None, counters, loss, None, None, dataset.stats, stopped=True), tokenizer
    model_dir = checkpoints.save_model(output_dir / MODEL_DIR)
    if cfg.checkpoint.every_steps > 0:
        log(f"checkpoints in {checkpoints.root} (the loop waited {checkpoints.blocked_s:.2f} s on saves)")
    log(f"wrote {output_dir}: config.yaml, metrics.jsonl ({counters.step} steps), model/ "
        f"(load with AutoModelForCausalLM.from_pretrained({str(model_dir)!r}))")
    plain = model if not info.is_distributed else None  # the trained module itself, for evaluation
    result = TrainResult(output_dir, model_dir, counters, loss, None, plain, dataset.stats)
    return result, tokenizer
