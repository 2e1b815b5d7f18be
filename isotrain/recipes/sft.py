"""Pre-training / SFT (`isotrain train`): what the recipe adds to the run session (session.py).

    sizes      GA steps from the global batch (sizes.py); model, MoE, layout and chunked-loss checks; the
               held-out rows read, so that a wrong eval.path is reported before training
    build      tokenizer -> dataset (tokenized once, cached; or a weighted mixture of sources, each its own
               cache entry) -> model and optimizer on the mesh -> the packing check on this model -> the
               world-size-free sampler
    step k     this rank's micro-batches of global batch k (read by a pipeline's first and last stages only;
               its middle stages get their position ids and counts: train/stage_data.py) -> train_step (one
               globally normalised gradient, one optimizer step) -> exact counters and the metrics row (a
               mixture's per-source sums added)
    after      exact-match accuracy of the final model on the held-out prompts
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console

from isotrain.config import TrainRunConfig
from isotrain.data.collate import collate
from isotrain.data.mixture import Mixture, SourceCounters
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import read_rows
from isotrain.models.checks import check_prompt_room, max_positions
from isotrain.models.loading import check_layout_fits, checked_config, count_parameters
from isotrain.models.packing_check import packing_needs_mask
from isotrain.models.unwrap import hf_model, unwrap
from isotrain.moe.metrics import router_metrics
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.session import Recipe, RunResult, Session, run_session
from isotrain.sizes import plan_batches
from isotrain.train.chunked_loss import check_chunked_loss_settings, check_head_is_linear
from isotrain.train.evaluate import exact_match
from isotrain.train.metrics import flops_per_token, peak_tflops
from isotrain.train.run_loop import RunState
from isotrain.train.sample_log import SampleLog
from isotrain.train.schedule import lr_of_step
from isotrain.train.setup import prepare_data, prepare_model, prepare_tokenizer, step_options
from isotrain.train.stage_data import stage_micro_batches
from isotrain.train.step import train_step


def train(cfg: TrainRunConfig, console: Console | None = None) -> RunResult:
    """Pre-train or fine-tune `cfg.model` on `cfg.data`; with eval.path, report the final exact-match accuracy."""
    return run_session(cfg, SFT, console)


class SFT(Recipe):
    def __init__(self, cfg: TrainRunConfig, degrees):
        self.cfg = cfg
        self.plan = plan_batches(cfg, degrees)
        self.model_config = checked_config(cfg)
        check_moe_section(cfg.moe, self.model_config)
        check_layout_fits(cfg.model, degrees)
        check_chunked_loss_settings(cfg.train.loss_chunk_tokens, degrees.tp)
        self.eval_rows = None
        if cfg.eval.path is not None:
            self.eval_rows = read_rows(cfg.eval.path, "prompt_completion", "eval.path").rows[: cfg.eval.max_samples]

    def build(self, session: Session) -> None:
        cfg, info, parallel = self.cfg, session.info, session.parallel
        self.session = session
        self.tokenizer = prepare_tokenizer(cfg, info, session.output_dir, session.log)
        positions = max_positions(self.model_config)
        if self.eval_rows and positions is not None:
            check_prompt_room(self.tokenizer, [row["prompt"] for row in self.eval_rows], cfg.eval.max_new_tokens,
                              "eval.max_new_tokens", positions, f"the model's {positions} positions",
                              f"eval.path={cfg.eval.path!r}")
        self.dataset = prepare_data(cfg, info, self.tokenizer, session.log)
        self.data_stats = self.dataset.stats
        self.model, self.optimizer = prepare_model(cfg, info, self.tokenizer, parallel)
        document_mask = packing_needs_mask(cfg.data.packing, cfg.model.dtype, self.model, parallel, info.device,
                                           session.log)  # probed on this model
        if cfg.train.loss_chunk_tokens:
            check_head_is_linear(self.model, info.device)
        self.num_params = count_parameters(self.model)
        session.log(f"model: {self.num_params:,} parameters; data: {len(self.dataset)} samples, "
                    f"{self.data_stats.total_input_tokens:,} tokens, {self.data_stats.total_trained_tokens:,} trained")
        self.sampler = GlobalBatchSampler(self.dataset.epoch_samples, self.plan.global_batch_size, cfg.train.seed,
                                          epoch_table=self.dataset.epoch_table)
        self.options = step_options(cfg, parallel, document_mask=document_mask,
                                    router=router_settings(cfg.moe, hf_model(self.model).config))
        peak = peak_tflops(cfg.train.peak_tflops, info.device)
        self.world_peak_tflops = peak * info.world_size if peak else None  # None when unknown: no mfu field

    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "data_fingerprint": self.dataset.fingerprint}

    def start(self, state: RunState) -> None:
        # A mixture's per-source sums are a function of the step alone (data/mixture.py): a resumed run, on any
        # layout, recomputes them for the steps before state.step instead of saving them.
        self.source_counters = SourceCounters(self.dataset, self.sampler, state.step) \
            if isinstance(self.dataset, Mixture) else None
        info = self.session.info
        self.sample_log = SampleLog(self.session.output_dir, info.rank, info.is_main, state.step) \
            if self.cfg.data.log_samples else None

    def close(self) -> None:
        if getattr(self, "sample_log", None) is not None:  # None until start(), which a refused run never reaches
            self.sample_log.close()

    def step(self, state: RunState) -> dict:
        """Step `state.step`: this rank's micro-batches of global batch `state.step` -> one optimizer step."""
        cfg, plan, session = self.cfg, self.plan, self.session
        index_lists = self.sampler.micro_batches(state.step, session.parallel.dp_rank, plan.dp_size,
                                                 plan.micro_batch_size)
        # Compiled and packed: every row is padded to data.max_seq_len, so the model compiles for one shape
        # instead of one per row length (packed rows nearly fill max_seq_len, so the padding costs little).
        length = cfg.data.max_seq_len if cfg.train.compile and cfg.data.packing else None
        pad_id = self.tokenizer.pad_token_id
        samples = []  # stays empty on a pipeline's middle stages, which read none (train/stage_data.py)

        def read(indices: list[int]) -> dict:
            samples.append([self.dataset[i] for i in indices])
            return collate(samples[-1], pad_id, length)

        micro_batches = stage_micro_batches(read, index_lists, session.parallel, cfg.train.loss_reduction,
                                            session.info.device)
        if self.sample_log is not None and samples:  # (the union of the ranks' lines is still the global batch)
            self.sample_log.write(state.step + 1, [i for indices in index_lists for i in indices],
                                  [sample for batch in samples for sample in batch])
        lr = lr_of_step(cfg.train, state.step)
        start = time.perf_counter()
        result = train_step(self.model, self.optimizer, micro_batches, lr, self.options, session.info.device,
                            before_update=session.checkpoints.before_update)
        step_s = time.perf_counter() - start
        state.counters["tokens_seen"] += result.num_input_tokens
        state.counters["trained_tokens"] += result.num_trained_tokens
        state.counters["samples_seen"] += result.num_samples
        row = self._metrics_row(state.counters, result, lr, step_s)
        if self.source_counters is not None:
            row.update(self.source_counters.add_step(state.step))
        return row

    def _metrics_row(self, counters: dict, result, lr: float, step_s: float) -> dict:
        tokens_per_s = result.num_input_tokens / step_s
        row = {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "tokens_seen": counters["tokens_seen"],
               "trained_tokens": counters["trained_tokens"], "samples_seen": counters["samples_seen"],
               "tokens_per_s": tokens_per_s, "step_s": step_s}
        if self.world_peak_tflops is not None:
            base = unwrap(self.model).config
            mean_len = result.num_input_tokens / max(result.num_samples, 1)
            flops_tok = flops_per_token(self.num_params, base.num_hidden_layers, base.hidden_size, mean_len)
            row["mfu"] = tokens_per_s * flops_tok / (self.world_peak_tflops * 1e12)
        if result.router is not None:
            row.update(router_metrics(result.router))
        return row

    def loading_hint(self, model_dir: Path) -> str:
        return f" (load with AutoModelForCausalLM.from_pretrained({str(model_dir)!r}))"

    def after_shutdown(self, result: RunResult) -> None:
        # Several processes: the saved directory is evaluated once the process group is gone (from_pretrained
        # on one rank inside a group can hang in transformers 5).
        if not self.session.info.is_main or self.eval_rows is None or result.stopped:
            return
        model = result.model if result.model is not None else _load_saved(result.model_dir)
        result.eval_after = self.eval_after = exact_match(model, self.tokenizer, self.eval_rows,
                                                          self.cfg.eval.max_new_tokens)
        self.session.console.print(f"exact-match accuracy on {len(self.eval_rows)} held-out prompts: "
                                   f"{result.eval_after:.1%}")


def _load_saved(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own output says what was loaded
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
