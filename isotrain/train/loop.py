"""Pre-training / SFT, top to bottom.

set up (sizes checked first) -> resume -> run_loop with `sft_step` (this rank's micro-batches of global
batch k -> train_step -> counters and metrics row) -> save the final model -> exact-match evaluation.
"""

from __future__ import annotations

import functools
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from isotrain.checkpoint.files import atomic_write_text
from isotrain.checkpoint.manager import MODEL_DIR, SFT_COUNTERS, CheckpointContract, CheckpointManager
from isotrain.config import TrainRunConfig as Config, dump_config
from isotrain.data.cache import tokenizer_fingerprint
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import read_rows
from isotrain.models.checks import check_prompt_room, max_positions
from isotrain.models.loading import check_layout_fits, checked_config, count_parameters
from isotrain.models.packing_check import packing_needs_mask
from isotrain.models.unwrap import hf_model, unwrap
from isotrain.moe.metrics import router_metrics
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.dist import DistInfo, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import ParallelState, build_parallel
from isotrain.parallel.tp import check_replicated
from isotrain.sizes import BatchPlan, plan_batches
from isotrain.train.chunked_loss import check_chunked_loss_settings, check_head_is_linear
from isotrain.train.evaluate import exact_match
from isotrain.train.metrics import MetricsWriter, flops_per_token, peak_tflops
from isotrain.train.run_loop import RunState, run_loop, stopped_message
from isotrain.train.schedule import lr_at, schedule_settings
from isotrain.train.setup import prepare_data, prepare_model, prepare_tokenizer, start_run
from isotrain.train.step import StepOptions, step_options, train_step


@dataclass
class Counters:
    """What a finished SFT run reports: its step and the exact sums over all ranks."""

    step: int = 0
    tokens_seen: int = 0
    trained_tokens: int = 0
    samples_seen: int = 0


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


@dataclass
class Run:
    """What an SFT step works on, built once by `_train`."""

    cfg: Config
    info: DistInfo
    parallel: ParallelState
    plan: BatchPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: object
    sampler: GlobalBatchSampler
    checkpoints: CheckpointManager
    pad_id: int
    options: StepOptions
    world_peak_tflops: float | None  # of all ranks together; None when unknown (no mfu field)
    num_params: int


def sft_step(run: Run, state: RunState) -> dict:
    """Step `state.step`: this rank's micro-batches of global batch `state.step` -> one optimizer step."""
    cfg, info, plan = run.cfg, run.info, run.plan
    index_lists = run.sampler.micro_batches(state.step, run.parallel.dp_rank, plan.dp_size, plan.micro_batch_size)
    # Compiled and packed: every row is padded to data.max_seq_len, so the model compiles for one shape instead of
    # one per row length (packed rows nearly fill max_seq_len, so the padding costs little).
    length = cfg.data.max_seq_len if cfg.train.compile and cfg.data.packing else None
    micro_batches = [collate([run.dataset[i] for i in indices], run.pad_id, length) for indices in index_lists]
    lr = lr_at(state.step, lr=cfg.train.lr, schedule=cfg.train.schedule, warmup_steps=cfg.train.warmup_steps,
               max_steps=cfg.train.max_steps, min_lr_ratio=cfg.train.min_lr_ratio)
    start = time.perf_counter()
    result = train_step(run.model, run.optimizer, micro_batches, lr, run.options, info.device,
                        before_update=run.checkpoints.before_update)
    step_s = time.perf_counter() - start
    state.counters["tokens_seen"] += result.num_input_tokens
    state.counters["trained_tokens"] += result.num_trained_tokens
    state.counters["samples_seen"] += result.num_samples
    return _metrics_row(run, state.counters, result, lr, step_s)


def _metrics_row(run: Run, counters: dict, result, lr: float, step_s: float) -> dict:
    tokens_per_s = result.num_input_tokens / step_s
    row = {
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens_seen": counters["tokens_seen"],
        "trained_tokens": counters["trained_tokens"],
        "samples_seen": counters["samples_seen"],
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
    }
    if run.world_peak_tflops is not None:
        base = unwrap(run.model).config
        mean_len = result.num_input_tokens / max(result.num_samples, 1)
        flops_tok = flops_per_token(run.num_params, base.num_hidden_layers, base.hidden_size, mean_len)
        row["mfu"] = tokens_per_s * flops_tok / (run.world_peak_tflops * 1e12)
    if result.router is not None:
        row.update(router_metrics(result.router))
    return row


def _eval_rows(cfg: Config) -> list[dict] | None:
    """The held-out rows, read at start so that a wrong eval.path is reported before training, not after."""
    if cfg.eval.path is None:
        return None
    return read_rows(cfg.eval.path, "prompt_completion", "eval.path").rows[: cfg.eval.max_samples]


def _evaluate(rows: list[dict], cfg: Config, model, tokenizer, console) -> float | None:
    accuracy = exact_match(model, tokenizer, rows, cfg.eval.max_new_tokens)
    console.print(f"exact-match accuracy on {len(rows)} held-out prompts: {accuracy:.1%}")
    return accuracy


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    info = init_distributed()
    console = console or Console(stderr=False)
    try:
        with ExitStack() as scope:  # the run's hold on output_dir, released however _train ends
            result, tokenizer, eval_rows = _train(cfg, info, console, scope)
    finally:
        shutdown_distributed()
    if info.is_main and eval_rows is not None and not result.stopped:
        # Several processes: evaluate the saved directory once the process group is gone
        # (from_pretrained on one rank inside a group can hang in transformers 5).
        model = result.model if result.model is not None else _load_saved(result.model_dir)
        result.accuracy = _evaluate(eval_rows, cfg, model, tokenizer, console)
    return result


def _load_saved(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own output says what was loaded
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _start_state(resumed) -> RunState:
    if resumed is None or resumed.weights_only:
        return RunState(0, {key: 0 for key in SFT_COUNTERS})
    return RunState(resumed.step, dict(resumed.counters))


def _train(cfg: Config, info: DistInfo, console: Console,
           scope: ExitStack) -> tuple[TrainResult, object, list[dict] | None]:
    # soft_wrap: a line names paths whole, in a terminal and in a log file alike
    log = functools.partial(console.print, soft_wrap=True) if info.is_main else (lambda *a, **k: None)
    degrees = resolve_dims(cfg.parallel, info.world_size)
    plan = plan_batches(cfg, degrees)  # invariant 7: every size checked before any work
    model_cfg = checked_config(cfg)
    check_moe_section(cfg.moe, model_cfg)
    check_layout_fits(cfg.model, degrees)
    check_chunked_loss_settings(cfg.train.loss_chunk_tokens, degrees.tp)
    eval_rows = _eval_rows(cfg)
    output_dir = start_run(cfg, info, console, plan, degrees, scope)
    tokenizer = prepare_tokenizer(cfg, info, output_dir, log)
    positions = max_positions(model_cfg)
    if eval_rows and positions is not None:
        check_prompt_room(tokenizer, [row["prompt"] for row in eval_rows], cfg.eval.max_new_tokens,
                          "eval.max_new_tokens", positions, f"the model's {positions} positions",
                          f"eval.path={cfg.eval.path!r}")
    dataset = prepare_data(cfg, info, tokenizer, log)
    parallel = build_parallel(degrees, info.device, info.rank)
    model, optimizer = prepare_model(cfg, info, tokenizer, parallel)
    document_mask = packing_needs_mask(cfg, model, parallel, info.device, log)  # before any step, on this model
    if cfg.train.loss_chunk_tokens:
        check_head_is_linear(model, info.device)
    log(f"model: {count_parameters(model):,} parameters; data: {len(dataset)} samples, "
        f"{dataset.stats.total_input_tokens:,} tokens, {dataset.stats.total_trained_tokens:,} trained")
    sampler = GlobalBatchSampler(len(dataset), plan.global_batch_size, cfg.train.seed)
    checkpoints = _checkpoint_manager(cfg, info, degrees, model, optimizer, tokenizer, dataset, sampler, log)
    checkpoints.clean_leftovers()
    state = _start_state(checkpoints.resume())
    if info.is_main:  # only now: a run refused above leaves the previous run's config.yaml as it was
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))
    peak = peak_tflops(cfg.train.peak_tflops, info.device)
    options = step_options(cfg, parallel, document_mask=document_mask,
                           router=router_settings(cfg.moe, hf_model(model).config))
    run = Run(cfg, info, parallel, plan, model, optimizer, dataset, sampler, checkpoints, tokenizer.pad_token_id,
              options, peak * info.world_size if peak else None, count_parameters(model))
    writer = MetricsWriter(output_dir, info.is_main, cfg.logging.tensorboard, start_step=state.step)
    try:
        run_loop(cfg, info, state, functools.partial(sft_step, run), checkpoints, writer, console,
                 after_first_step=lambda: check_replicated(model, parallel.tp_group))
    finally:
        writer.close()
    counters = Counters(step=state.step, **state.counters)
    if state.stopped_by is not None:
        # Preemption leaves little time: no final model/ (the checkpoint is itself a Hugging Face model directory)
        # and no evaluation, just the resumable checkpoint.
        log(stopped_message(state.stopped_by, state.step, checkpoints.root))
        return (TrainResult(output_dir, None, counters, state.loss, None, None, dataset.stats, stopped=True), tokenizer,
                eval_rows)
    model_dir = checkpoints.save_model(output_dir / MODEL_DIR)
    if cfg.checkpoint.every_steps > 0:
        log(f"checkpoints in {checkpoints.root} (the loop waited {checkpoints.blocked_s:.2f} s on saves)")
    log(f"wrote {output_dir}: config.yaml, metrics.jsonl ({state.step} steps), model/ "
        f"(load with AutoModelForCausalLM.from_pretrained({str(model_dir)!r}))")
    plain = model if not info.is_distributed else None  # the trained module itself, for evaluation
    result = TrainResult(output_dir, model_dir, counters, state.loss, None, plain, dataset.stats)
    return result, tokenizer, eval_rows


def _checkpoint_manager(cfg: Config, info: DistInfo, degrees, model, optimizer, tokenizer, dataset,
                        sampler: GlobalBatchSampler, log) -> CheckpointManager:
    """SFT checkpoints: the default counters, and a resume must match the data order, schedule and tokenizer."""
    contract = CheckpointContract(extra_state={
        "sampler": sampler.state_dict(),
        "schedule": schedule_settings(cfg.train),
        "data_fingerprint": Path(dataset.cache_path).name if dataset.cache_path else None,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    })
    layout = {"world_size": info.world_size, **dict(degrees.as_rows())}
    return CheckpointManager(cfg, info.rank, info.world_size, layout, model, optimizer, tokenizer, contract, log)
