"""`isotrain embed`, top to bottom.

sizes checked -> run directory -> rows (skipped ones reported) -> tokenizer, samples -> model, optimizer ->
checkpoint manager (resume) -> run_loop with `embed_step` (this rank's micro-batches of global batch k ->
GradCache step -> optimizer step) -> final model.
"""

from __future__ import annotations

import functools
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from isotrain.checkpoint.files import atomic_write_text
from isotrain.checkpoint.manager import MODEL_DIR, SFT_COUNTERS, CheckpointContract, CheckpointManager
from isotrain.config import Config, dump_config
from isotrain.data.cache import tokenizer_fingerprint
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.embed.batch import EmbedMicroBatch
from isotrain.embed.data import read_pairs, read_training_pairs, skipped_report, text_id, tokenize_rows
from isotrain.embed.encode import EncodeOptions
from isotrain.embed.evaluate import evaluate_retrieval
from isotrain.embed.export import sentence_transformers_files
from isotrain.embed.gradcache import embed_forward_backward
from isotrain.embed.loss import LossSettings
from isotrain.embed.model import build_embedder, check_embed_layout, embed_tokenizer
from isotrain.errors import ConfigError
from isotrain.models.loading import declared_config
from isotrain.moe.settings import check_moe_section, num_experts
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.dist import DistInfo, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.sizes import plan_batches
from isotrain.train.metrics import MetricsWriter
from isotrain.train.optim import build_optimizer
from isotrain.train.run_loop import RunState, run_loop, stopped_message
from isotrain.train.schedule import lr_at, schedule_settings
from isotrain.train.setup import start_run
from isotrain.train.step import optimizer_step


@dataclass
class EmbedRun:
    cfg: Config
    info: DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    samples: list
    sampler: GlobalBatchSampler
    checkpoints: CheckpointManager
    settings: LossSettings
    options: EncodeOptions
    dp_size: int
    dp_group: object


@dataclass
class EmbedResult:
    output_dir: Path
    model_dir: Path | None  # None when stopped early
    step: int
    final_loss: float
    counters: dict
    eval_before: dict | None = None  # eval_recall@1, ... (None without eval.path)
    eval_after: dict | None = None


def _refuse_router_terms(moe_cfg) -> None:
    """The contrastive loss has no router terms: a `moe.*` setting would change nothing, so it is refused."""
    for key, value in moe_cfg.model_dump().items():
        if value != type(moe_cfg).model_fields[key].default:
            raise ConfigError(f"moe.{key}={value!r} has no effect in isotrain embed, whose contrastive loss has no "
                              f"router terms; remove moe.{key}")


def embed_step(run: EmbedRun, state: RunState) -> dict:
    """Step `state.step`: this rank's micro-batches of global batch `state.step` -> one optimizer step."""
    cfg = run.cfg
    rank = dist.get_rank() if run.info.is_distributed else 0
    index_lists = run.sampler.micro_batches(state.step, rank, run.dp_size, cfg.train.micro_batch_size)
    micro_batches = [EmbedMicroBatch([run.samples[i] for i in idx], [int(i) for i in idx]) for idx in index_lists]
    lr = lr_at(state.step, lr=cfg.train.lr, schedule=cfg.train.schedule, warmup_steps=cfg.train.warmup_steps,
               max_steps=cfg.train.max_steps, min_lr_ratio=cfg.train.min_lr_ratio)
    start = time.perf_counter()
    result = embed_forward_backward(run.model, micro_batches, run.settings, run.options, state.step,
                                    run.info.device, run.dp_group)
    run.checkpoints.before_update()
    parameters = [p for p in run.model.parameters() if p.requires_grad]
    norm = optimizer_step(run.optimizer, parameters, lr, cfg.train.grad_clip, result.loss)
    step_s = time.perf_counter() - start
    # Every token of every text is trained on (each text is embedded and receives gradient).
    state.counters["tokens_seen"] += result.num_input_tokens
    state.counters["trained_tokens"] += result.num_input_tokens
    state.counters["samples_seen"] += result.num_samples
    return {"loss": result.loss, "lr": lr, "grad_norm": norm, **state.counters,
            "tokens_per_s": result.num_input_tokens / step_s, "pairs_per_s": result.num_samples / step_s,
            "step_s": step_s}


def embed_train(cfg: Config, console: Console | None = None) -> EmbedResult:
    info = init_distributed()
    console = console or Console(stderr=False)
    try:
        with ExitStack() as scope:
            return _embed(cfg, info, console, scope)
    finally:
        shutdown_distributed()


def _embed(cfg: Config, info: DistInfo, console: Console, scope: ExitStack) -> EmbedResult:
    log = functools.partial(console.print, soft_wrap=True) if info.is_main else (lambda *a, **k: None)
    degrees = resolve_dims(cfg.parallel, info.world_size)
    check_embed_layout(degrees)
    plan = plan_batches(cfg, degrees)  # invariant 7: every size checked before any work
    check_moe_section(cfg.moe, declared_config(cfg.model))  # moe.* on a dense model would do nothing
    _refuse_router_terms(cfg.moe)
    if cfg.train.loss_chunk_tokens:
        raise ConfigError(f"train.loss_chunk_tokens={cfg.train.loss_chunk_tokens} applies to the SFT cross-entropy "
                          "only, and isotrain embed has no vocabulary logits; remove train.loss_chunk_tokens")
    rows, num_negatives, negatives_note = read_training_pairs(cfg.data.path, cfg.embed.hard_negatives)
    report = skipped_report(rows)
    held_out = None  # read now: a wrong eval.path is reported before any work
    if cfg.eval.path is not None:
        held_out = read_pairs(cfg.eval.path, 0, "eval.path").rows[: cfg.eval.max_samples]
    output_dir = start_run(cfg, info, console, plan, degrees, scope)
    log(negatives_note)
    if report:
        log(f"data.path {cfg.data.path!r}: {report}")
    texts = [t for row in rows.rows for t in (row["query"], row["positive"], *(row.get("negatives") or []))]
    tokenizer = embed_tokenizer(cfg, texts, info, output_dir, log)
    samples = tokenize_rows(rows.rows, tokenizer, cfg.data.max_seq_len, num_negatives, cfg.embed.query_prefix)
    parallel = build_parallel(degrees, info.device, info.rank)
    model = build_embedder(cfg, tokenizer, info.device, parallel)
    if num_experts(model.config) is not None:
        log("note: the model's routers train without a load-balancing loss (isotrain embed has no router terms)")
    optimizer = build_optimizer(model, cfg.train)
    sampler = GlobalBatchSampler(len(samples), plan.global_batch_size, cfg.train.seed)
    # The texts, the query prefix and the hard negatives per query: resuming with another count (a changed setting,
    # or unset on rows that now resolve otherwise) would change the samples, so the "data" check refuses it.
    fingerprint = text_id("\n".join(texts) + f"\n{cfg.embed.query_prefix}\n{num_negatives}")
    contract = CheckpointContract(extra_state={"sampler": sampler.state_dict(), "schedule": schedule_settings(cfg.train),
                                               "data_fingerprint": str(fingerprint),
                                               "tokenizer_sha256": tokenizer_fingerprint(tokenizer)})
    layout = {"world_size": info.world_size, **dict(degrees.as_rows())}
    checkpoints = CheckpointManager(cfg, info.rank, info.world_size, layout, model, optimizer, tokenizer, contract, log)
    if info.is_main:  # every checkpoint and the final model are also sentence-transformers directories
        checkpoints.static.update(sentence_transformers_files(cfg.embed.pooling, model.config.hidden_size,
                                                              cfg.embed.normalize, cfg.data.max_seq_len))
    checkpoints.clean_leftovers()
    resumed = checkpoints.resume()
    state = RunState(0, {k: 0 for k in SFT_COUNTERS}) if resumed is None or resumed.weights_only \
        else RunState(resumed.step, dict(resumed.counters))
    if info.is_main:
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))
    log(f"embedding {len(samples)} pairs ({num_negatives} hard negatives each), global batch "
        f"{plan.global_batch_size}: every query is scored against all {plan.global_batch_size * (1 + num_negatives)} "
        "documents of its global batch")
    settings = LossSettings(cfg.embed.temperature, cfg.embed.symmetric, tuple(cfg.embed.matryoshka_dims),
                            cfg.embed.mask_duplicates)
    options = EncodeOptions(cfg.embed.pooling, tokenizer.pad_token_id, tokenizer.padding_side, cfg.embed.chunk_tokens,
                            cfg.train.seed)
    run = EmbedRun(cfg, info, model, optimizer, samples, sampler, checkpoints, settings, options, plan.dp_size,
                   parallel.dp_group)
    writer = MetricsWriter(output_dir, info.is_main, cfg.logging.tensorboard, start_step=state.step)
    evaluate = None if held_out is None else functools.partial(_evaluate, run, tokenizer, held_out, log)
    before = after = None
    try:
        if evaluate is not None and state.step == 0:
            before = evaluate("before training")
            writer.write({"step": 0, **before})
        run_loop(cfg, info, state, functools.partial(embed_step, run), checkpoints, writer, console,
                 evaluate=None if evaluate is None else lambda step: evaluate(f"after step {step}"),
                 eval_every=cfg.embed.eval_every)
        if state.stopped_by is None and evaluate is not None:
            after = evaluate("after training")
            writer.write({"step": state.step, **after})
    finally:
        writer.close()
    if state.stopped_by is not None:
        log(stopped_message(state.stopped_by, state.step, checkpoints.root))
        return EmbedResult(output_dir, None, state.step, state.loss, state.counters, before)
    model_dir = checkpoints.save_model(output_dir / MODEL_DIR)
    log(f"wrote {output_dir}: config.yaml, metrics.jsonl ({state.step} steps), model/ (also a sentence-transformers "
        f"directory: SentenceTransformer({str(model_dir)!r}))")
    return EmbedResult(output_dir, model_dir, state.step, state.loss, state.counters, before, after)


def embed_evaluate(cfg: Config, console: Console | None = None) -> dict:
    """`isotrain embed --eval-only`: the retrieval metrics of model.name_or_path on eval.path, on one process."""
    console = console or Console(stderr=False)
    if cfg.eval.path is None:
        raise ConfigError("isotrain embed --eval-only needs held-out rows; set eval.path to a file of "
                          "{query, positive, negatives} rows")
    if cfg.model.name_or_path is None:
        raise ConfigError("isotrain embed --eval-only evaluates a trained model; set model.name_or_path to its directory")
    held_out = read_pairs(cfg.eval.path, 0, "eval.path").rows[: cfg.eval.max_samples]
    tokenizer = embed_tokenizer(cfg, [], DistInfo(0, 1, 0, torch.device("cpu")), Path(cfg.output_dir), console.print)
    model = build_embedder(cfg, tokenizer, torch.device("cpu"))
    options = EncodeOptions(cfg.embed.pooling, tokenizer.pad_token_id, tokenizer.padding_side, cfg.embed.chunk_tokens,
                            cfg.train.seed)
    metrics = evaluate_retrieval(model, tokenizer, held_out, options, cfg.data.max_seq_len, torch.device("cpu"),
                                 cfg.embed.query_prefix)
    shown = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    console.print(f"{cfg.model.name_or_path}: retrieval on {len(held_out)} held-out rows: {shown}", soft_wrap=True)
    return metrics


def _evaluate(run: EmbedRun, tokenizer, held_out: list[dict], log, when: str) -> dict:
    """Retrieval metrics of the held-out rows (every rank computes the same values; rank 0 prints them)."""
    metrics = evaluate_retrieval(run.model, tokenizer, held_out, run.options, run.cfg.data.max_seq_len,
                                 run.info.device, run.cfg.embed.query_prefix)
    shown = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    log(f"{when}: retrieval on {len(held_out)} held-out rows: {shown}")
    return {f"eval_{name}": value for name, value in metrics.items()}
