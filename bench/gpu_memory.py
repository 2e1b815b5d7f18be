"""The memory estimate against a live CUDA run, for bench/gpu_check.py: fp32, bf16, bf16 + activation checkpointing.

For each setting, one process builds the model with isotrain's builder, takes isotrain's AdamW and reads every
term of `isotrain estimate-memory` off the live tensors (`isotrain.memory.measure.measure_terms`: parameters,
gradients and moments from their storages, activations / compute copies / logits from what a real forward saves
for backward). Then one more `train_step` (moments present from the start) gives the peak:

    peak = torch.cuda.max_memory_allocated() during that step − memory_allocated() before the model was built

which is set beside the estimate's total (every term as if alive at once: docs/memory.md). Terms must agree within
5 % (model states to the byte); the peak is reported, not asserted: it also holds cuBLAS's workspace and the
kernels' scratch, and gradients that grow while activations are freed.
"""

from __future__ import annotations

import gc

import torch

from isotrain.config import build_config
from isotrain.memory.estimate import estimate_memory
from isotrain.memory.measure import measure_terms
from isotrain.models.build import build
from isotrain.models.tokenizer import train_tokenizer
from isotrain.models.unwrap import hf_model
from isotrain.moe.settings import router_settings
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import single_process
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import step_options
from isotrain.train.step import train_step

MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 1024}
MICRO, SEQ = 4, 1024
TINY = {**MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 32}
SETTINGS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "full")]
EXACT = ("parameters", "gradients", "optimizer moments")
TOLERANCE = 0.05


def config(model: dict, micro: int, seq: int, dtype: str, checkpointing: str):
    return build_config({"model": {"config": model, "dtype": dtype}, "data": {"max_seq_len": seq},
                         "train": {"micro_batch_size": micro, "global_batch_size": micro,
                                   "activation_checkpointing": checkpointing}})


def micro_batch(micro: int, seq: int, vocab: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (micro, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).expand(micro, seq).clone(),
            "segment_ids": torch.zeros(micro, seq, dtype=torch.long), "num_input_tokens": micro * seq,
            "num_trained_tokens": micro * seq}


def measure_setting(cfg, tokenizer, device: torch.device, micro: int, seq: int, vocab: int) -> dict:
    parallel = single_process(ParallelDims(1, 1, 1))
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    model = build(cfg.model, tokenizer, 0, parallel, device,
                  compute_dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else None,
                  activation_checkpointing=cfg.train.activation_checkpointing == "full")
    optimizer = build_optimizer(model, cfg.train)
    options = step_options(cfg, parallel, router=router_settings(cfg.moe, hf_model(model).config))
    terms = measure_terms(model, optimizer, options, (micro_batch(micro, seq, vocab, 0), micro_batch(micro, seq, vocab, 1)),
                          device)
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optimizer, [micro_batch(micro, seq, vocab, 2)], 1e-4, options, device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    del model, optimizer
    gc.collect()
    return {"measured": terms, "peak_bytes": peak}


def compare(estimated: dict, measured: dict) -> list[dict]:
    rows = []
    for name, value in estimated.items():
        if name not in measured:
            # Not measurable from tensors (the recomputed layer exists only inside backward): reported, not judged.
            rows.append({"term": name, "estimated": value, "measured": None, "ok": True if value == 0 else None})
            continue
        got = measured[name]
        ok = got == value if name in EXACT else abs(value - got) <= TOLERANCE * max(got, 1)
        rows.append({"term": name, "estimated": value, "measured": got, "ok": ok})
    return rows


def run(dry_run: bool, device: torch.device, report) -> list[dict]:
    model, micro, seq = (TINY, 2, 32) if dry_run else (MODEL, MICRO, SEQ)
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    results = []
    for dtype, checkpointing in SETTINGS:
        cfg = config(model, micro, seq, dtype, checkpointing)
        estimate = estimate_memory(cfg, 1, vocab_size=model["vocab_size"], device=device.type)
        got = measure_setting(cfg, tokenizer, device, micro, seq, model["vocab_size"])
        estimated = {t.name: t.bytes for t in estimate.terms}
        results.append({"dtype": dtype, "activation_checkpointing": checkpointing, "micro_batch": micro, "seq": seq,
                        "terms": compare(estimated, got["measured"]), "estimated_total_bytes": estimate.total_bytes,
                        "peak_bytes": got["peak_bytes"]})
        report(results)
    return results
