"""Measure every memory term on this rank of a real run and estimate the same run from its config.

    memory_worker.py OUT.json LAYOUT [LAYOUT ...]

    LAYOUT: [moe-|mixtral-]RxSxT[-epN][-cN][-vN][-ulyssesN|-ringN][-ppN[-gpipe|-interleaved|-izb|-zbv|-dualpipev]
            [-splitA+B...][-tied]][-fp32|-bf16]
        dp_replicate x dp_shard x tp, expert parallel N, chunked loss of N tokens, vocabulary N instead of 64,
        context parallel N in that style, a pipeline of N ranks (1f1b or gpipe with PP_MICROBATCHES micro-batches
        per step, or interleaved 1f1b: 2 stages per rank, 2N layers, 2N micro-batches; tied input and output
        embeddings), fp32 or bf16 without checkpointing only (else fp32 and bf16, checkpointing none and full)

For each layout and each of fp32 / bf16 × activation checkpointing none / full: build the tiny model (a
Llama, or with `moe-` a qwen3_moe, with `mixtral-` a mixtral, of 4 experts, top-2) with isotrain's builder, run one real `train_step`
(gradients are measured between backward and update, optimizer state after it), then count what one more
forward keeps for backward, and FSDP2's buffers at their peak during that forward and backward. Rank 0
writes [{variant, rank, measured, estimated}].

Under expert parallelism the estimate assumes balanced routing, so the measured run is routed that way:
every router's choice is replaced by token t -> experts (t·k + j) mod E, j < k (`balanced_routing`), which
gives each expert the same number of (token, slot) pairs on every rank (the router still runs, so what it
saves is real).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from isotrain.config import build_config
from isotrain.memory.estimate import estimate_memory
from isotrain.memory.measure import measure_terms
from isotrain.memory.measure_pipeline import measure_pipeline_terms
from isotrain.models.build import build
from isotrain.models.tokenizer import train_tokenizer
from isotrain.models.unwrap import hf_model
from isotrain.moe.settings import router_settings
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import step_options

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64}
TINY_MOE = {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
# Mixtral's experts are intermediate_size wide: TP must not narrow them (they are replicated over TP).
TINY_MIXTRAL = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": None}
MODELS = {None: TINY, "moe": TINY_MOE, "mixtral": TINY_MIXTRAL}
MICRO, SEQ = 2, 16
PP_MICROBATCHES = 3  # 1f1b on 2 stages: 2 in flight on the first, 1 on the last; gpipe: 3 on both


def micro_batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).expand(MICRO, SEQ).clone(),
            "segment_ids": torch.zeros(MICRO, SEQ, dtype=torch.long), "num_input_tokens": MICRO * SEQ,
            "num_trained_tokens": MICRO * SEQ}


def parse_layout(layout: str) -> tuple[str | None, int, int, int, int, int, int]:
    """(model: None, "moe" or "mixtral", dp_replicate, dp_shard, tp, ep, chunk, vocabulary) of e.g.
    `moe-1x2x1-ep2`, `1x2x1-v512` or `1x2x1-c8` (train.loss_chunk_tokens=8)."""
    parts = layout.split("-")
    moe = parts[0] if parts[0] in MODELS else None
    dims = parts[1] if moe else parts[0]
    ep = next((int(part[2:]) for part in parts if part.startswith("ep")), 1)
    chunk = next((int(part[1:]) for part in parts if part.startswith("c") and part[1:].isdigit()), 0)
    vocab = next((int(part[1:]) for part in parts if part.startswith("v")), TINY["vocab_size"])
    replicate, shard, tp = (int(x) for x in dims.split("x"))
    return moe, replicate, shard, tp, ep, chunk, vocab


def context_parallel(layout: str) -> tuple[int, str]:
    """(parallel.cp, parallel.cp_style) of a layout: `-ulysses2` or `-ring2`, else (1, "ulysses")."""
    for part in layout.split("-"):
        for style in ("ulysses", "ring"):
            if part.startswith(style):
                return int(part[len(style):]), style
    return 1, "ulysses"


SEVERAL_STAGES = {"interleaved": "interleaved_1f1b", "izb": "interleaved_zb", "zbv": "zbv", "dualpipev": "dualpipev"}


def pipeline(layout: str) -> tuple[int, str, list[int] | None]:
    """(parallel.pp, parallel.pp_schedule, parallel.pp_split) of a layout: `-pp2` (1f1b), `-pp2-gpipe`, or with 2
    stages per rank `-pp2-interleaved`, `-pp2-izb` (interleaved zero bubble), `-pp2-zbv` or `-pp2-dualpipev`; with
    `-split3+1` the decoder layers of each stage; else (1, "1f1b", None)."""
    parts = layout.split("-")
    pp = next((int(part[2:]) for part in parts if part.startswith("pp")), 1)
    split = next(([int(n) for n in part[5:].split("+")] for part in parts if part.startswith("split")), None)
    several = next((SEVERAL_STAGES[part] for part in parts if part in SEVERAL_STAGES), None)
    return pp, several or ("gpipe" if "gpipe" in parts else "1f1b"), split


def run_config(layout: str, dtype: str, checkpointing: str):
    moe, replicate, shard, tp, ep, chunk, vocab = parse_layout(layout)
    cp, style = context_parallel(layout)
    pp, schedule, split = pipeline(layout)
    interleaved = schedule in SEVERAL_STAGES.values()  # 2 stages per rank of one layer each; 2·pp micro-batches
    steps = (2 * pp if interleaved else PP_MICROBATCHES) if pp > 1 else 1
    tied = "tied" in layout.split("-")
    model = {**MODELS[moe], "vocab_size": vocab, "tie_word_embeddings": tied}
    if interleaved:
        model["num_hidden_layers"] = 2 * pp
    if split:
        model["num_hidden_layers"] = sum(split)
    return build_config({"model": {"config": model, "dtype": dtype},
                         "data": {"max_seq_len": SEQ},
                         "train": {"micro_batch_size": MICRO, "global_batch_size": MICRO * replicate * shard * steps,
                                   "activation_checkpointing": checkpointing, "loss_chunk_tokens": chunk},
                         "parallel": {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "ep": ep, "cp": cp,
                                      "cp_style": style, "pp": pp, "pp_schedule": schedule,
                                      "pp_stages_per_rank": 2 if interleaved else 1, "pp_split": split}})


def balanced_routing(model) -> None:
    """Route token t of every MoE layer to experts (t·k + j) mod E, j < k, after the router ran."""

    def route(module, args, output):
        logits, scores, indices = output
        tokens, top_k = indices.shape
        slots = torch.arange(tokens * top_k, device=indices.device).view(tokens, top_k)
        return logits, scores, slots % module.num_experts

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(route)


def measure(cfg, info, tokenizer) -> dict:
    degrees = resolve_dims(cfg.parallel, info.world_size)
    parallel = build_parallel(degrees, info.device, info.rank)
    model = build(cfg.model, tokenizer, 0, parallel, info.device, compute_dtype=torch.bfloat16
                  if cfg.model.dtype == "bfloat16" else None,
                  activation_checkpointing=cfg.train.activation_checkpointing == "full", loss_parallel=True)
    if cfg.parallel.ep > 1:
        balanced_routing(model)
    optimizer = build_optimizer(model, cfg.train)
    options = step_options(cfg, parallel, router=router_settings(cfg.moe, hf_model(model).config))
    if degrees.pp > 1:
        num_microbatches = cfg.train.global_batch_size // (MICRO * degrees.dp_size)
        steps = [[micro_batch(100 * step + 10 * parallel.dp_rank + index) for index in range(num_microbatches)]
                 for step in range(2)]
        return measure_pipeline_terms(model, optimizer, options, (steps[0], steps[1]), info.device), parallel.pp_rank
    return measure_terms(model, optimizer, options, (micro_batch(parallel.dp_rank), micro_batch(10 + parallel.dp_rank)),
                         info.device), None


def main() -> None:
    out, *layouts = sys.argv[1:]
    info = init_distributed()
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    rows = []
    # `-fp32` / `-bf16`: that dtype without checkpointing only (a 4-process layout, kept short)
    only = {"fp32": "float32", "bf16": "bfloat16"}
    variants = [(layout, dtype, checkpointing) for layout in layouts for dtype in ("float32", "bfloat16")
                for checkpointing in ("none", "full")
                if not {*only} & {*layout.split("-")}
                or (checkpointing == "none" and dtype in {only[part] for part in layout.split("-") if part in only})]
    for layout, dtype, checkpointing in variants:
        cfg = run_config(layout, dtype, checkpointing)
        measured, stage = measure(cfg, info, tokenizer)
        estimate = estimate_memory(cfg, info.world_size, vocab_size=parse_layout(layout)[-1], stage=stage)
        estimated = {t.name: t.bytes for t in estimate.terms}
        gathered = [None] * info.world_size
        row = {"variant": f"{layout} {dtype} ac={checkpointing}", "rank": info.rank, "measured": measured,
               "estimated": estimated}
        if info.is_distributed:
            torch.distributed.all_gather_object(gathered, row)
        else:
            gathered = [row]
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
