"""Contrastive embedding training (`isotrain embed`): what the recipe adds to the run session (session.py).

    sizes      GA steps from the global batch (sizes.py); data parallel only; the rows read (skipped ones
               reported; `data.sources`: each source's, mixed by SFT's rule, data/mixture.py) and the held-out rows
    build      tokenizer -> tokenized (query, positive, negatives) samples -> encoder and optimizer
    start      retrieval metrics on the held-out rows before training
    step k     this rank's micro-batches of global batch k -> GradCache: every query scored against every
               document of the global batch (embed/gradcache.py) -> one optimizer step
    finish     retrieval metrics of the final model; every checkpoint and the final model are also
               sentence-transformers directories
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console

from isotrain.config import EmbedRunConfig
from isotrain.data.mixture import MixtureOrder, SourceCounters
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.embed.batch import EmbedMicroBatch
from isotrain.embed.data import (read_pairs, read_training_sources, sample_tokens, skipped_report, text_id,
                                 tokenize_rows)
from isotrain.embed.evaluate import evaluate_retrieval
from isotrain.embed.export import sentence_transformers_files
from isotrain.embed.gradcache import embed_forward_backward
from isotrain.embed.loss import LossSettings
from isotrain.embed.model import (build_embedder, check_embed_layout, check_embed_settings, embed_tokenizer,
                                   encode_options)
from isotrain.errors import ConfigError
from isotrain.parallel.dims import num_experts
from isotrain.parallel.dist import DistInfo
from isotrain.session import Recipe, RunResult, Session, run_session
from isotrain.sizes import plan_batches
from isotrain.train.optim import build_optimizer
from isotrain.train.run_loop import RunState
from isotrain.train.schedule import lr_of_step
from isotrain.train.step import optimizer_step


def embed_train(cfg: EmbedRunConfig, console: Console | None = None) -> RunResult:
    """Contrastive training of `cfg.model` on the (query, positive[, negatives]) rows of `cfg.data.path` (or
    `cfg.data.sources`)."""
    return run_session(cfg, Embed, console)


class Embed(Recipe):
    def __init__(self, cfg: EmbedRunConfig, degrees):
        self.cfg = cfg
        check_embed_layout(degrees)
        check_embed_settings(cfg)
        self.plan = plan_batches(cfg, degrees)
        self.eval_every = cfg.embed.eval_every
        sources = cfg.data.sources or []
        self.fields = [f"data.sources[{i}].path" for i in range(len(sources))] or ["data.path"]
        self.paths = [source.path for source in sources] or [cfg.data.path]
        self.sources, self.num_negatives, self.negatives_note = read_training_sources(
            list(zip(self.paths, self.fields)), cfg.embed.hard_negatives)
        self.held_out = None  # read now: a wrong eval.path is reported before any work
        if cfg.eval.path is not None:
            self.held_out = read_pairs(cfg.eval.path, 0, "eval.path").rows[: cfg.eval.max_samples]

    def build(self, session: Session) -> None:
        cfg, info, plan = self.cfg, session.info, self.plan
        self.session = session
        session.log(self.negatives_note)
        for field, path, result in zip(self.fields, self.paths, self.sources):
            report = skipped_report(result)
            if report:
                session.log(f"{field} {path!r}: {report}")
        rows = [row for result in self.sources for row in result.rows]
        self.texts = [t for row in rows for t in (row["query"], row["positive"], *(row.get("negatives") or []))]
        self.tokenizer = embed_tokenizer(cfg, self.texts, info, session.output_dir, session.log)
        self.samples = tokenize_rows(rows, self.tokenizer, cfg.data.max_seq_len, self.num_negatives,
                                     cfg.embed.query_prefix)
        self.model = build_embedder(cfg, self.tokenizer, info.device, session.parallel)
        if num_experts(self.model.config) is not None:
            session.log("note: the model's routers train without a load-balancing loss (isotrain embed has no "
                        "router terms)")
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.mixture = None
        if cfg.data.sources:  # global batch k: the k-th of the mixture's epochs (data/mixture.py)
            tokens = sample_tokens(self.samples)
            self.mixture = MixtureOrder([len(result.rows) for result in self.sources],
                                        [source.weight for source in cfg.data.sources],
                                        [source.label for source in cfg.data.sources], cfg.train.seed,
                                        plan.global_batch_size, tokens, tokens)
            for line in self.mixture.describe("pairs"):
                session.log(line)
        self.sampler = GlobalBatchSampler(len(self.samples) if self.mixture is None else self.mixture.epoch_samples,
                                          plan.global_batch_size, cfg.train.seed,
                                          epoch_table=self.mixture.epoch_table if self.mixture is not None else None)
        negatives = self.num_negatives
        session.log(f"embedding {len(self.samples)} pairs ({negatives} hard negatives each), global batch "
                    f"{plan.global_batch_size}: every query is scored against all "
                    f"{plan.global_batch_size * (1 + negatives)} documents of its global batch")
        self.settings = LossSettings(cfg.embed.temperature, cfg.embed.symmetric, tuple(cfg.embed.matryoshka_dims),
                                     cfg.embed.mask_duplicates)
        self.options = encode_options(cfg, self.tokenizer, session.parallel.dims.fsdp)

    def extra_state(self) -> dict:
        # The count of hard negatives changes every query's candidates: a resume with another one is refused
        # like other data.
        spec = "\n".join(self.texts) + f"\n{self.cfg.embed.query_prefix}\n{self.num_negatives}"
        if self.mixture is not None:  # where each source starts and its weight decide the order too
            spec += f"\n{self.mixture.sizes.tolist()}\n{[repr(float(w)) for w in self.mixture.weights]}"
        fingerprint = text_id(spec)
        return {"sampler": self.sampler.state_dict(), "data_fingerprint": str(fingerprint)}

    def static_files(self) -> dict[str, bytes]:
        cfg = self.cfg
        return sentence_transformers_files(cfg.embed.pooling, self.model.config.hidden_size, cfg.embed.normalize,
                                           cfg.data.max_seq_len)

    def start(self, state: RunState) -> dict | None:
        # A mixture's per-source sums are a function of the step alone: a resumed run recomputes them.
        self.source_counters = SourceCounters(self.mixture, self.sampler, state.step) \
            if self.mixture is not None else None
        if self.held_out is None or state.step != 0:
            return None
        self.eval_before = self._evaluate("before training")
        return self.eval_before

    def step(self, state: RunState) -> dict:
        """Step `state.step`: this rank's micro-batches of global batch `state.step` -> one optimizer step."""
        cfg, parallel = self.cfg, self.session.parallel
        index_lists = self.sampler.micro_batches(state.step, parallel.dp_rank, self.plan.dp_size,
                                                 cfg.train.micro_batch_size)
        micro_batches = [EmbedMicroBatch([self.samples[i] for i in idx], [int(i) for i in idx]) for idx in index_lists]
        lr = lr_of_step(cfg.train, state.step)
        start = time.perf_counter()
        result = embed_forward_backward(self.model, micro_batches, self.settings, self.options, state.step,
                                        self.session.info.device, parallel.dp_group)
        self.session.checkpoints.before_update()
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        norm = optimizer_step(self.optimizer, parameters, lr, cfg.train.grad_clip, result.loss)
        step_s = time.perf_counter() - start
        # Every token of every text is trained on (each text is embedded and receives gradient).
        state.counters["tokens_seen"] += result.num_input_tokens
        state.counters["trained_tokens"] += result.num_input_tokens
        state.counters["samples_seen"] += result.num_samples
        row = {"loss": result.loss, "lr": lr, "grad_norm": norm, **state.counters,
               "tokens_per_s": result.num_input_tokens / step_s, "pairs_per_s": result.num_samples / step_s,
               "step_s": step_s}
        if self.source_counters is not None:
            row.update(self.source_counters.add_step(state.step))
        return row

    def evaluate(self, step: int) -> dict:
        return self._evaluate(f"after step {step}")

    def finish(self, state: RunState, model_dir: Path) -> dict | None:
        if self.held_out is None:
            return None
        self.eval_after = self._evaluate("after training")
        return self.eval_after

    def _evaluate(self, when: str) -> dict:
        """Retrieval metrics of the held-out rows (every rank computes the same values; rank 0 prints them)."""
        cfg = self.cfg
        metrics = evaluate_retrieval(self.model, self.tokenizer, self.held_out, self.options, cfg.data.max_seq_len,
                                     self.session.info.device, cfg.embed.query_prefix)
        shown = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
        self.session.log(f"{when}: retrieval on {len(self.held_out)} held-out rows: {shown}")
        return {f"eval_{name}": value for name, value in metrics.items()}

    def loading_hint(self, model_dir: Path) -> str:
        return f" (also a sentence-transformers directory: SentenceTransformer({str(model_dir)!r}))"


def embed_evaluate(cfg: EmbedRunConfig, console: Console | None = None) -> dict:
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
    options = encode_options(cfg, tokenizer, fsdp=False)
    metrics = evaluate_retrieval(model, tokenizer, held_out, options, cfg.data.max_seq_len, torch.device("cpu"),
                                 cfg.embed.query_prefix)
    shown = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    console.print(f"{cfg.model.name_or_path}: retrieval on {len(held_out)} held-out rows: {shown}", soft_wrap=True)
    return metrics
