"""Long-tailed SFT document lengths for `train_throughput.py --lengths NAME`, and the Hugging Face Trainer runs
that train on them (padded default collator; `DataCollatorWithFlattening`).

Document lengths (tokens, bos and eos included) are drawn, seeded, from a log-normal whose mean is a published
mean of an instruction/chat set, then rounded and clipped to [MIN_TOKENS, max_seq_len] as an SFT run truncates
its long rows. These are fits, not the data: the papers give means, not the shape, so the spread σ is our
choice, picked for a long tail like the length histograms those papers plot.

    length ~ LogNormal(μ, σ),  mean = exp(μ + σ²/2)  =>  μ = ln(mean) - σ²/2,   median = exp(μ)

- `sharegpt`: mean 499 tokens = ShareGPT's mean input (161.31) + output (337.99) lengths reported by Kwon et
  al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023, §6.1);
  σ = 1.0, so the median is 303 and 11 % of the drawn lengths exceed 1024 and are clipped to it (mean after
  clipping 407, p90 = max = 1024).
- `alpaca`: mean 78 tokens = Alpaca's mean input (19.31) + output (58.45) lengths from the same paper; σ = 0.8,
  clipped to 256 (median 56, p90 157, mean after clipping 75).
- `longtail`: the shape an outside measurement of isotrain used (median about 180, mean about 256, clipped to
  [8, 1024]): mean 256, σ = √(2 ln(256 / 180)) = 0.84, so that the median is 180.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_TOKENS = 8


@dataclass(frozen=True)
class LengthModel:
    mean_tokens: float  # the published mean the log-normal is fitted to
    sigma: float  # our choice (see the module docstring)
    max_seq_len: int  # lengths are clipped to it; also isotrain's packed row length
    source: str


LENGTH_MODELS = {
    "sharegpt": LengthModel(499.0, 1.0, 1024, "ShareGPT mean input+output tokens (Kwon et al. 2023), sigma 1.0"),
    "alpaca": LengthModel(78.0, 0.8, 256, "Alpaca mean input+output tokens (Kwon et al. 2023), sigma 0.8"),
    "longtail": LengthModel(256.0, math.sqrt(2 * math.log(256 / 180)), 1024,
                            "log-normal with median 180 and mean 256 tokens, clipped to [8, 1024]"),
}


def document_lengths(name: str, num_documents: int, seed: int) -> np.ndarray:
    """Token lengths of `num_documents` documents, deterministic in (name, num_documents, seed)."""
    return document_lengths_of(LENGTH_MODELS[name], num_documents, seed)


def document_lengths_of(model: LengthModel, num_documents: int, seed: int) -> np.ndarray:
    """Token lengths of `num_documents` documents drawn from `model`, deterministic in its arguments."""
    mu = math.log(model.mean_tokens) - model.sigma**2 / 2
    drawn = np.random.default_rng(seed).lognormal(mu, model.sigma, num_documents)
    return np.clip(np.rint(drawn), MIN_TOKENS, model.max_seq_len).astype(np.int64)


def write_documents(path: Path, lengths: np.ndarray, seed: int) -> None:
    """Text rows of random letters; with isotrain's char tokenizer a row of n - 2 letters is n tokens (bos, eos)."""
    rng = np.random.default_rng(seed + 1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as f:
        for n in lengths:
            f.write(json.dumps({"text": "".join(rng.choice(letters, int(n) - 2))}) + "\n")


def length_summary(lengths: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return (f"{len(lengths)} documents, tokens: mean {lengths.mean():.0f}, median {p50:.0f}, p90 {p90:.0f}, "
            f"p99 {p99:.0f}, max {lengths.max()}")


class CountingCollator:
    """Wraps a collator and records each micro-batch's real (non-padding) tokens and tensor slots."""

    def __init__(self, collator):
        self.collator, self.real_tokens, self.slots = collator, [], []

    def __call__(self, features):
        batch = self.collator(features)
        self.real_tokens.append(sum(len(f["input_ids"]) for f in features))
        self.slots.append(batch["input_ids"].numel())
        return batch


def step_timer(after_step):
    """A Trainer callback timing each optimizer step (on_step_begin to on_step_end), then calling `after_step`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)
            after_step()

    return StepTimer()


def run_hf_variable(work: Path, name: str, model, tokenizer, documents: list[list[int]], flatten: bool,
                    docs_per_micro: int, ga: int, hparams: dict, warmup: int, after_step) -> tuple[float, float]:
    """HF Trainer over `documents` (one epoch, its own shuffle): (real tokens/s over the timed steps, the real
    fraction of the padded slots). Padded: `DataCollatorForLanguageModeling(mlm=False)`, transformers' padding
    collator for causal LMs (labels = input_ids, padding -> -100, attention mask). Flattening: every
    micro-batch's documents in one row with restarting position ids, first label of each document -100."""
    from transformers import (DataCollatorForLanguageModeling, DataCollatorWithFlattening, PrinterCallback, Trainer,
                              TrainingArguments)


    base = DataCollatorWithFlattening() if flatten else DataCollatorForLanguageModeling(tokenizer, mlm=False)
    collator, timer = CountingCollator(base), step_timer(after_step)
    args = TrainingArguments(
        output_dir=str(work / "runs" / name), per_device_train_batch_size=docs_per_micro,
        gradient_accumulation_steps=ga, num_train_epochs=1, report_to=[], logging_steps=10**6, save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **hparams,
    )
    rows = [{"input_ids": ids} for ids in documents]
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary would break up the table
    trainer.train()
    tokens = [sum(collator.real_tokens[i : i + ga]) for i in range(0, len(collator.real_tokens), ga)]
    steps = min(len(tokens), len(timer.seconds))
    rate = sum(tokens[warmup:steps]) / sum(timer.seconds[warmup:steps])
    return rate, sum(collator.real_tokens) / sum(collator.slots)
