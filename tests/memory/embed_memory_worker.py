"""Measure every memory term of a live `isotrain embed` step on this rank and estimate the same run from its config.

    embed_memory_worker.py OUT.json LAYOUT [LAYOUT ...]      LAYOUT: RxS (dp_replicate x dp_shard)

For each layout and each variant (VARIANTS: the model, pooling, hard negatives, embed.chunk_tokens and loss
options, model.dtype, checkpointing): build the tiny encoder with the recipe's builder (build_embedder: fp32
weights, the pooler frozen, FSDP2 under dp_shard, bf16 by FSDP2 or by the encode options' autocast), run one real
step of the recipe's `embed_forward_backward` and its optimizer step, then the instrumented step
(memory/measure_embed.py). Every text is data.max_seq_len tokens, the length the estimate assumes. Rank 0
writes [{variant, rank, measured, estimated}].
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch

from isotrain.config import build_config
from isotrain.embed.batch import EmbedMicroBatch, EmbedSample
from isotrain.embed.loss import LossSettings
from isotrain.embed.model import build_embedder, encode_options
from isotrain.memory.estimate_embed import estimate_embed_memory
from isotrain.memory.measure_embed import measure_embed_terms
from isotrain.models.tokenizer import train_tokenizer
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.train.optim import build_optimizer

# A BERT-style encoder with its pooler (frozen by the recipe), dropout on the hidden states and on the attention
# probabilities (which makes the recipe run eager attention), and a Qwen3 decoder as an embedder.
BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 64, "vocab_size": 64, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1}
QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 64,
         "vocab_size": 64}
GLOBAL, MICRO, SEQ = 8, 2, 16
# name -> (model config, embed section, model.dtype and train settings): no chunk bound (a micro-batch's texts in
# one forward), 3 texts per forward with the symmetric, Matryoshka loss on CLS vectors and no attention dropout (sdpa),
# and a decoder's last token; the first in bf16 too (autocast's weight copies, or FSDP2's bf16 buffers), and the
# decoder in bf16 with every layer checkpointed.
BF16, BF16_AC = {"dtype": "bfloat16"}, {"dtype": "bfloat16", "activation_checkpointing": "full"}
VARIANTS = {
    "bert-mean-n1": (BERT, {"pooling": "mean", "hard_negatives": 1, "chunk_tokens": 0}, {}),
    "bert-cls-n2-c48-sym": ({**BERT, "attention_probs_dropout_prob": 0.0},
                            {"pooling": "cls", "hard_negatives": 2, "chunk_tokens": 3 * SEQ, "symmetric": True,
                             "matryoshka_dims": [64, 32]}, {}),
    "qwen3-last-n0-c32": (QWEN3, {"pooling": "last", "hard_negatives": 0, "chunk_tokens": 2 * SEQ}, {}),
    "bert-mean-n1-bf16": (BERT, {"pooling": "mean", "hard_negatives": 1, "chunk_tokens": 0}, BF16),
    "qwen3-last-n0-c32-bf16-ac": (QWEN3, {"pooling": "last", "hard_negatives": 0, "chunk_tokens": 2 * SEQ}, BF16_AC),
}


def run_config(variant: str, replicate: int, shard: int):
    model, embed, extra = VARIANTS[variant]
    train = {key: value for key, value in extra.items() if key != "dtype"}
    return build_config({"model": {"config": model, "dtype": extra.get("dtype", "float32")},
                         "data": {"max_seq_len": SEQ}, "embed": embed,
                         "train": {"micro_batch_size": MICRO, "global_batch_size": GLOBAL, **train},
                         "parallel": {"dp_replicate": replicate, "dp_shard": shard}}, "embed")


def local_steps(cfg, dp_rank: int, dp_size: int, seed: int) -> list[EmbedMicroBatch]:
    """This rank's micro-batches of a global batch of texts of SEQ tokens (distinct texts: distinct ids)."""
    rng = random.Random(seed)
    negatives = cfg.embed.hard_negatives
    text = lambda: [rng.randrange(1, 64) for _ in range(SEQ)]  # noqa: E731
    samples = [EmbedSample(text(), text(), [text() for _ in range(negatives)], 3 * i, 3 * i + 1,
                           [10_000 + negatives * i + j for j in range(negatives)]) for i in range(GLOBAL)]
    local = GLOBAL // dp_size
    mine = list(range(dp_rank * local, (dp_rank + 1) * local))
    return [EmbedMicroBatch([samples[i] for i in mine[at:at + MICRO]], mine[at:at + MICRO])
            for at in range(0, local, MICRO)]


def measure(cfg, info, tokenizer) -> dict:
    degrees = resolve_dims(cfg.parallel, info.world_size)
    parallel = build_parallel(degrees, info.device, info.rank)
    model = build_embedder(cfg, tokenizer, info.device, parallel)
    optimizer = build_optimizer(model, cfg.train)
    settings = LossSettings(cfg.embed.temperature, cfg.embed.symmetric, tuple(cfg.embed.matryoshka_dims),
                            cfg.embed.mask_duplicates)
    options = encode_options(cfg, tokenizer, degrees.fsdp)
    steps = tuple(local_steps(cfg, parallel.dp_rank, degrees.dp_size, seed) for seed in (0, 1))
    return measure_embed_terms(model, optimizer, steps, settings, options, info.device, parallel.dp_group)


def main() -> None:
    out, *layouts = sys.argv[1:]
    info = init_distributed()
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    rows = []
    for layout in layouts:
        replicate, shard = (int(x) for x in layout.split("x"))
        for variant in VARIANTS:
            cfg = run_config(variant, replicate, shard)
            measured = measure(cfg, info, tokenizer)
            estimate = estimate_embed_memory(cfg, info.world_size, vocab_size=64, device="cpu")
            row = {"variant": f"{layout} {variant}", "rank": info.rank, "measured": measured,
                   "estimated": {t.name: t.bytes for t in estimate.terms}}
            gathered = [row]
            if info.is_distributed:
                gathered = [None] * info.world_size
                torch.distributed.all_gather_object(gathered, row)
            rows.extend(gathered)
    if info.is_main:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    if info.is_distributed:
        shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
