"""Training throughput on one GPU for bench/gpu_check.py: isotrain (eager, compiled, packed) next to a minimal
PyTorch loop and the Hugging Face Trainer, in one process, one tool after the other.

Every tool trains a fresh Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP
5632, vocabulary 32000, untied head: 1.10 B parameters) in bf16 autocast over fp32 weights, AdamW (fused, lr 3e-4,
betas 0.9/0.95, no weight decay, constant lr), gradient clipping at norm 1.0, on full rows of 4096 tokens (the
same token ids for every tool: isotrain's char-tokenized samples of random letters), 8 rows per optimizer step
in micro-batches of 2 (GA 4). The minimal loop does that math by hand (HF's mean token loss / GA, which is the
global token mean here: every row has the same trained tokens), the HF Trainer with `bf16=True`.

    tokens/s = tokens of the timed steps / wall time from the end of the last warm-up step to the end of the last
               step (the GPU synchronised at both ends; loading batches, logging and the step's own host syncs inside)
    MFU      = tokens/s × FLOPs per token / the GPU's dense bf16 peak (isotrain.train.metrics.KNOWN_PEAK_TFLOPS)
    FLOPs per token = 6 (N − N_embedding) + 12 L d s   (torchtitan's count: N parameters without the input
               embedding, a lookup; L layers, d hidden size, s the length attended: 4096 on full rows; for packed
               rows s = Σ n² / Σ n over the documents, since each token attends only inside its document)

Packed: documents of long-tailed lengths (bench/sft_lengths.py's ShareGPT fit, clipped to 4096 instead of 1024)
packed whole into rows of 4096 (`data.packing=true`); its tokens/s counts real tokens. "packed" attends with SDPA and
transformers' per-document mask, "packed varlen" with `model.attn_implementation=varlen` (flash's variable-length
kernel, isotrain/models/varlen.py). The minimal loop runs first
and again before the compiled run (the GPU's clocks drift with heat): isotrain's ratios use the mean of the two.
"""

from __future__ import annotations

import gc
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from isotrain.config import build_config
from isotrain.data import GlobalBatchSampler, collate, prepare_dataset
from isotrain.models.tokenizer import train_tokenizer
from isotrain import session
from isotrain.recipes.sft import train
from isotrain.train.metrics import peak_tflops
from sft_lengths import LengthModel, document_lengths_of, write_documents

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False}
# --dry-run: the same code on a tiny model, on CPU, in seconds.
LLAMA_TINY = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
LR, BETAS, EPS, SEED = 3e-4, (0.9, 0.95), 1e-8, 0
GLOBAL_BATCH, MICRO = 8, 2
PACKED_LENGTHS = LengthModel(499.0, 1.0, 4096, "ShareGPT mean input+output tokens (Kwon et al. 2023), sigma 1.0")
TARGET_EAGER_VS_MINIMAL, TARGET_COMPILED_VS_EAGER = 0.97, 1.1


@dataclass
class Setting:
    model: dict
    seq_len: int
    warmup: int
    steps: int
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def setting(dry_run: bool, warmup: int, steps: int) -> Setting:
    if dry_run:
        return Setting(LLAMA_TINY, 64, 1, 2, torch.device("cpu"))
    return Setting(LLAMA_1B, 4096, warmup, steps, torch.device("cuda"))


def sync(s: Setting) -> None:
    if s.cuda:
        torch.cuda.synchronize()


def flops_per_token(model: dict, attended: float) -> float:
    d, layers, vocab = model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]
    kv = d // model["num_attention_heads"] * model["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * model["intermediate_size"] + 2 * d  # attention, MLP, norms
    non_embedding = layers * per_layer + d + vocab * d  # final norm, untied head
    return 6.0 * non_embedding + 12.0 * layers * d * attended


def write_rows(path: Path, num_rows: int, chars: int) -> None:
    """Rows of random letters longer than the row length: each is cut to exactly seq_len tokens."""
    rng = np.random.default_rng(SEED)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as f:
        for _ in range(num_rows):
            f.write(json.dumps({"text": "".join(rng.choice(letters, chars))}) + "\n")


def isotrain_config(s: Setting, work: Path, name: str, data: Path, *, packing=False, compile_model=False,
                    global_batch=GLOBAL_BATCH, attention=None):
    return build_config({
        "output_dir": str(work / "runs" / name),
        "model": {"config": dict(s.model), "dtype": "bfloat16", "attn_implementation": attention},
        "tokenizer": {"type": "char"},
        "data": {"path": str(data), "format": "text", "max_seq_len": s.seq_len, "packing": packing,
                 "cache_dir": str(work / "cache"), "overflow": "truncate"},
        "eval": {"path": None},
        "train": {"global_batch_size": global_batch, "micro_batch_size": MICRO, "max_steps": s.warmup + s.steps,
                  "seed": SEED, "lr": LR, "schedule": "constant", "weight_decay": 0.0, "betas": list(BETAS),
                  "eps": EPS, "grad_clip": 1.0, "log_every": 1, "compile": compile_model},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress": False},
    })


class StepClock:
    """End times of steps (GPU synchronised), and the tokens of each."""

    def __init__(self, s: Setting):
        self.s, self.ends, self.tokens = s, [], []

    def mark(self, tokens: int) -> None:
        sync(self.s)
        self.ends.append(time.perf_counter())
        self.tokens.append(tokens)

    def rate(self) -> float:
        w = self.s.warmup
        return sum(self.tokens[w:]) / (self.ends[-1] - self.ends[w - 1])


def fresh_hf_model(s: Setting):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**s.model)
    torch.manual_seed(SEED)
    with torch.device(s.device):  # initialised where it trains (a 1 B model is slow to initialise on CPU)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def run_minimal(s: Setting, dataset, pad_id: int) -> StepClock:
    model = fresh_hf_model(s).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, SEED)
    ga = GLOBAL_BATCH // MICRO
    clock = StepClock(s)
    for step in range(s.warmup + s.steps):
        tokens = 0
        for index in sampler.micro_batches(step, 0, 1, MICRO):
            input_ids = collate([dataset[i] for i in index], pad_id)["input_ids"].to(s.device, non_blocking=True)
            with torch.autocast(s.device.type, dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, labels=input_ids).loss / ga  # HF shifts the labels itself
            loss.backward()
            tokens += input_ids.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark(tokens)
    return clock


def run_hf_trainer(s: Setting, work: Path, dataset) -> StepClock:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments, default_data_collator

    clock = StepClock(s)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.mark(GLOBAL_BATCH * s.seq_len)

    rows = [{"input_ids": torch.from_numpy(x.input_ids), "labels": torch.from_numpy(x.input_ids)}
            for x in dataset.samples]
    args = TrainingArguments(
        output_dir=str(work / "runs" / "hf"), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GLOBAL_BATCH // MICRO, max_steps=s.warmup + s.steps, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        max_grad_norm=1.0, report_to=[], logging_steps=10**6, save_strategy="no", use_cpu=not s.cuda,
        bf16=True, optim="adamw_torch_fused", dataloader_num_workers=0, seed=SEED, disable_tqdm=True)
    trainer = Trainer(model=fresh_hf_model(s), args=args, train_dataset=rows, data_collator=default_data_collator,
                      callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return clock


def run_isotrain(s: Setting, cfg, on_step=None) -> StepClock:
    """isotrain's own loop; the clock reads the end of each step where the loop writes its metrics row, and
    `on_step()` runs after it (a profiler's step)."""
    clock = StepClock(s)
    rows = []

    class ClockedWriter(session.MetricsWriter):
        def write(self, row: dict) -> None:
            super().write(row)
            previous = rows[-1]["tokens_seen"] if rows else 0
            rows.append(row)
            clock.mark(row["tokens_seen"] - previous)
            if on_step is not None:
                on_step()

    original = session.MetricsWriter
    session.MetricsWriter = ClockedWriter  # the session's one hook; the step itself is untouched
    try:
        result = train(cfg, console=Console(file=io.StringIO()))
    finally:
        session.MetricsWriter = original
    del result
    return clock


def attended_length(dataset) -> float:
    """Σ n² / Σ n over the documents of the packed samples (segment lengths)."""
    squares = total = 0
    for sample in dataset.samples:
        _, counts = np.unique(sample.segment_ids, return_counts=True)
        squares += int((counts.astype(np.int64) ** 2).sum())
        total += int(counts.sum())
    return squares / total


# Seconds a tool needs at least on one H100 (build, data, warm-up, steps); a tool is skipped when less time is
# left before the deadline, so that the check ends inside its limit with the other rows measured.
NEEDS_S = {"isotrain compiled": 150.0}
DEFAULT_NEEDS_S = 30.0


def measure(s: Setting, work: Path, tools: list[str], report, deadline: float = float("inf")) -> list[dict]:
    """Run `tools` in order while time is left before `deadline` (time.perf_counter()); `report(rows)` after each
    (a run cut short keeps what it measured)."""
    work.mkdir(parents=True, exist_ok=True)
    full = work / "rows.jsonl"
    write_rows(full, GLOBAL_BATCH * (s.warmup + s.steps), s.seq_len + 100)
    cfg = isotrain_config(s, work, "shared", full)
    texts = [json.loads(line)["text"] for line in full.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, "char", cfg.tokenizer.vocab_size)
    dataset = prepare_dataset(cfg.data, tokenizer, log=lambda *a, **k: None)
    peak = peak_tflops(None, s.device)
    rows: list[dict] = []
    for tool in tools:
        if time.perf_counter() + NEEDS_S.get(tool, DEFAULT_NEEDS_S) > deadline:
            rows.append({"tool": tool, "skipped": "not enough time left before the check's deadline"})
            report(rows)
            continue
        gc.collect()
        if s.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        attended = s.seq_len
        started = time.perf_counter()
        if tool.startswith("minimal loop"):
            clock = run_minimal(s, dataset, tokenizer.pad_token_id)
        elif tool == "HF Trainer":
            clock = run_hf_trainer(s, work, dataset)
        elif tool.startswith("isotrain packed"):
            packed_cfg, attended = packed_config(s, work, "varlen" if tool.endswith("varlen") else None)
            clock = run_isotrain(s, packed_cfg)
        else:
            compiled = tool == "isotrain compiled"
            if compiled:
                torch._dynamo.reset()
            clock = run_isotrain(s, isotrain_config(s, work, tool.replace(" ", "-"), full, compile_model=compiled))
        rate = clock.rate()
        flops = flops_per_token(s.model, attended)
        rows.append({"tool": tool, "tokens_per_s": rate, "flops_per_token": flops, "attended_length": attended,
                     "mfu": rate * flops / (peak * 1e12) if peak else None,
                     "peak_memory_bytes": torch.cuda.max_memory_allocated() if s.cuda else None,
                     "step_s": [b - a for a, b in zip(clock.ends[s.warmup - 1:], clock.ends[s.warmup:])],
                     "wall_s": time.perf_counter() - started})
        report(rows)
    return rows


def packed_config(s: Setting, work: Path, attention: str | None = None):
    """Long-tailed documents packed into rows of seq_len; about as many rows per step as the full-row tools."""
    documents = work / "documents.jsonl"
    model = LengthModel(PACKED_LENGTHS.mean_tokens, PACKED_LENGTHS.sigma, s.seq_len, PACKED_LENGTHS.source)
    # Enough documents for the steps: mean length after clipping is under the fit's mean.
    count = int(GLOBAL_BATCH * (s.warmup + s.steps) * s.seq_len / min(model.mean_tokens, s.seq_len / 4) * 1.5)
    write_documents(documents, document_lengths_of(model, count, SEED), SEED)
    cfg = isotrain_config(s, work, f"isotrain-packed-{attention}", documents, packing=True, attention=attention)
    texts = [json.loads(line)["text"] for line in documents.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, "char", cfg.tokenizer.vocab_size)
    dataset = prepare_dataset(cfg.data, tokenizer, log=lambda *a, **k: None)
    if len(dataset) < GLOBAL_BATCH * (s.warmup + s.steps):
        raise SystemExit(f"only {len(dataset)} packed rows for {s.warmup + s.steps} steps; write more documents")
    return cfg, attended_length(dataset)


def ratios(rows: list[dict]) -> dict[str, float]:
    """isotrain eager / minimal loop (the mean of its two runs), compiled / eager, packed / eager, eager / HF."""
    rate = {row["tool"]: row["tokens_per_s"] for row in rows if "tokens_per_s" in row}
    minimal = [v for k, v in rate.items() if k.startswith("minimal loop")]
    out = {}
    if minimal and "isotrain eager" in rate:
        out["eager / minimal loop"] = rate["isotrain eager"] / (sum(minimal) / len(minimal))
    if "isotrain compiled" in rate and "isotrain eager" in rate:
        out["compiled / eager"] = rate["isotrain compiled"] / rate["isotrain eager"]
    if "isotrain packed" in rate and "isotrain eager" in rate:
        out["packed (real tokens) / eager"] = rate["isotrain packed"] / rate["isotrain eager"]
    if "isotrain packed varlen" in rate and "isotrain eager" in rate:
        out["packed varlen (real tokens) / eager"] = rate["isotrain packed varlen"] / rate["isotrain eager"]
    if "isotrain packed varlen" in rate and "isotrain packed" in rate:
        out["packed varlen / packed sdpa"] = rate["isotrain packed varlen"] / rate["isotrain packed"]
    if "HF Trainer" in rate and "isotrain eager" in rate:
        out["eager / HF Trainer"] = rate["isotrain eager"] / rate["HF Trainer"]
    return out
