"""The pre-training / SFT loop, top to bottom.

set up (sizes checked first) -> for each step: this rank's micro-batches of global batch k ->
train_step -> counters and metrics -> save the final model -> exact-match evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from isotrain.config import Config, dump_config
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import read_rows
from isotrain.models.loading import count_parameters
from isotrain.parallel.dist import DistInfo, barrier, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_mesh
from isotrain.sizes import BatchPlan, plan_batches, resolve_degrees
from isotrain.train.evaluate import exact_match
from isotrain.train.final import save_final_model
from isotrain.train.metrics import MetricsWriter, ProgressBar, flops_per_token, peak_tflops
from isotrain.train.schedule import lr_at
from isotrain.train.setup import prepare_data, prepare_model, prepare_tokenizer, seed_everything
from isotrain.train.step import StepOptions, train_step


@dataclass
class Counters:
    step: int = 0
    tokens_seen: int = 0
    trained_tokens: int = 0
    samples_seen: int = 0


@dataclass
class TrainResult:
    output_dir: Path
    model_dir: Path
    counters: Counters
    final_loss: float
    accuracy: float | None
    model: object = None  # the trained model as a plain HF module, on rank 0 only
    data_stats: object = None  # the dataset's own totals (DataStats)


def plan_table(plan: BatchPlan, degrees) -> Table:
    table = Table(title="batch sizes", show_header=False)
    for name, value in [*vars(degrees).items(), *plan.as_rows()]:
        table.add_row(name, str(value))
    return table


def _step_options(cfg: Config, degrees) -> StepOptions:
    # FSDP2 casts parameters itself; DDP and single-process runs use autocast for bf16.
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and degrees.dp_shard == 1 else None
    return StepOptions(loss_reduction=cfg.train.loss_reduction, grad_clip=cfg.train.grad_clip, autocast_dtype=autocast)


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


def run_steps(cfg, info, plan, model, optimizer, dataset, pad_id, writer, console) -> tuple[Counters, float]:
    sampler = GlobalBatchSampler(len(dataset), plan.global_batch_size, cfg.train.seed)
    options = _step_options(cfg, resolve_degrees(cfg.parallel, info.world_size))
    base = getattr(model, "module", model).config
    world_peak = peak_tflops(cfg.train.peak_tflops, info.device)
    world_peak = world_peak * info.world_size if world_peak else None
    num_params = count_parameters(model)
    counters, loss = Counters(), float("nan")
    with ProgressBar(cfg.train.max_steps, info.is_main and cfg.logging.progress, console) as bar:
        for step in range(cfg.train.max_steps):
            index_lists = sampler.micro_batches(step, info.rank, plan.dp_size, plan.micro_batch_size)
            micro_batches = [collate([dataset[i] for i in indices], pad_id) for indices in index_lists]
            lr = lr_at(step, lr=cfg.train.lr, schedule=cfg.train.schedule, warmup_steps=cfg.train.warmup_steps,
                       max_steps=cfg.train.max_steps, min_lr_ratio=cfg.train.min_lr_ratio)
            start = time.perf_counter()
            result = train_step(model, optimizer, micro_batches, lr, options, info.device)
            step_s = time.perf_counter() - start
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
    return counters, loss


def _evaluate(cfg: Config, model_dir: Path, eval_model, tokenizer, console) -> float | None:
    if cfg.eval.path is None or eval_model is None:
        return None
    rows = read_rows(cfg.eval.path, "prompt_completion").rows[: cfg.eval.max_samples]
    accuracy = exact_match(eval_model, tokenizer, rows, cfg.eval.max_new_tokens)
    console.print(f"exact-match accuracy on {len(rows)} held-out prompts: {accuracy:.1%}")
    return accuracy


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    info = init_distributed()
    console = console or Console(stderr=False)
    try:
        return _train(cfg, info, console)
    finally:
        shutdown_distributed()


def _train(cfg: Config, info: DistInfo, console: Console) -> TrainResult:
    log = console.print if info.is_main else (lambda *a, **k: None)
    degrees = resolve_degrees(cfg.parallel, info.world_size)
    plan = plan_batches(cfg, degrees)  # invariant 7: every size checked before any work
    output_dir = Path(cfg.output_dir)
    if info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_config(cfg))
        console.print(plan_table(plan, degrees))
    barrier()
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    tokenizer = prepare_tokenizer(cfg, info, output_dir, log)
    dataset = prepare_data(cfg, info, tokenizer, log)
    mesh = build_mesh(degrees, info.device)
    model, optimizer = prepare_model(cfg, info, tokenizer, mesh, degrees)
    log(f"model: {count_parameters(model):,} parameters; data: {len(dataset)} samples, "
        f"{dataset.stats.total_input_tokens:,} tokens, {dataset.stats.total_trained_tokens:,} trained")
    writer = MetricsWriter(output_dir, info.is_main, cfg.logging.tensorboard)
    try:
        counters, loss = run_steps(cfg, info, plan, model, optimizer, dataset, tokenizer.pad_token_id, writer, console)
    finally:
        writer.close()
    model_dir = output_dir / "model"
    eval_model = save_final_model(model, tokenizer, model_dir, info)
    accuracy = _evaluate(cfg, model_dir, eval_model, tokenizer, console) if info.is_main else None
    log(f"wrote {output_dir}: config.yaml, metrics.jsonl ({counters.step} steps), model/ "
        f"(load with AutoModelForCausalLM.from_pretrained({str(model_dir)!r}))")
    return TrainResult(output_dir, model_dir, counters, loss, accuracy, eval_model, dataset.stats)
