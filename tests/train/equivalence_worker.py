"""Run 3 optimizer steps of a tiny Llama on a fixed dataset in one layout; rank 0 saves the results.

Launched by test_equivalence.py with torchrun (real processes, gloo) or in-process for 1 rank:
    equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH [naive]     (LAYOUTS: e.g. 2x1,1x2 = DDP then FSDP2)
One launch covers every given layout (a mesh and a model each), both loss reductions, in fp32 and in
fp64: results[(dp_replicate, dp_shard)][(reduction, dtype)]; run() is one layout in this process.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from isotrain.data.collate import collate
from isotrain.data.packing import Sample
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.models.unwrap import unwrap
from isotrain.parallel.apply import parallelize
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_mesh
from isotrain.sizes import ParallelDegrees
from isotrain.train.loss import token_losses
from isotrain.train.optim import build_optimizer
from isotrain.config import TrainConfig
from isotrain.train.step import StepOptions, forward_backward, optimizer_step

VOCAB = 64
GLOBAL_BATCH = 8
NUM_STEPS = 3


def make_samples(num: int = 16, seed: int = 0) -> list[Sample]:
    """Variable lengths (3..20), masked 'prompts', and one packed sample of two documents."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        lengths = [int(rng.integers(3, 21))] if i != 5 else [7, 9]
        ids, labels, positions, segments = [], [], [], []
        for seg, length in enumerate(lengths):
            doc = rng.integers(4, VOCAB, size=length)
            prompt_len = int(rng.integers(0, length - 1))
            target = np.concatenate([doc[1:], [-100]])
            target[: max(prompt_len - 1, 0)] = -100
            ids.append(doc), labels.append(target)
            positions.append(np.arange(length)), segments.append(np.full(length, seg))
        samples.append(Sample(np.concatenate(ids), np.concatenate(labels), np.concatenate(positions),
                              np.concatenate(segments), (i,)))
    return samples


def tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.use_cache = False
    return LlamaForCausalLM(config).to(dtype)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def naive_forward_backward(model, micro_batches) -> float:
    """The classic bug: mean per micro-batch, then averaged over micro-batches (single process only)."""
    total = 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        losses = token_losses(logits, mb["labels"])
        loss = losses.sum() / max(mb["num_trained_tokens"], 1) / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total


def run_layout(info, degrees, mesh, micro_batch: int, reduction: str, dtype: torch.dtype, naive: bool) -> dict:
    model = parallelize(tiny_model(dtype), mesh, degrees)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    samples = make_samples()
    sampler = GlobalBatchSampler(len(samples), GLOBAL_BATCH, seed=0)
    options = StepOptions(loss_reduction=reduction, grad_clip=1.0)
    params = [p for p in model.parameters()]
    losses, first_grads, counts = [], None, []
    for step in range(NUM_STEPS):
        index_lists = sampler.micro_batches(step, info.rank, degrees.dp_size, micro_batch)
        micro_batches = [collate([samples[i] for i in idx], pad_id=0) for idx in index_lists]
        if naive:
            loss, step_counts = naive_forward_backward(model, micro_batches), None
        else:
            loss, step_counts = forward_backward(model, micro_batches, options, info.device)
        if step == 0:
            first_grads = {n: full(p.grad) for n, p in unwrap(model).named_parameters()}
        losses.append(loss)
        counts.append(step_counts)
        optimizer_step(optimizer, params, lr=1e-2, grad_clip=1.0)
    weights = {n: full(p) for n, p in unwrap(model).named_parameters()}
    return {"losses": losses, "grads": first_grads, "weights": weights, "counts": counts}


def run(out: str, dp_replicate: int, dp_shard: int, micro_batch: int, naive: bool = False) -> None:
    """One layout in this process: results[(reduction, dtype)]."""
    torch.save(run_layouts([(dp_replicate, dp_shard)], micro_batch, naive)[(dp_replicate, dp_shard)], out)


def run_layouts(layouts: list[tuple[int, int]], micro_batch: int, naive: bool = False) -> dict | None:
    """Every (dp_replicate, dp_shard) layout in turn, each with its own mesh and models, in one launch
    (the processes start once): results[(dp_replicate, dp_shard)][(reduction, dtype)] on rank 0, else None."""
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for dp_replicate, dp_shard in layouts:
        degrees = ParallelDegrees(dp_replicate, dp_shard, 1)
        mesh = build_mesh(degrees, info.device)
        results[(dp_replicate, dp_shard)] = {
            (reduction, str(dtype)): run_layout(info, degrees, mesh, micro_batch, reduction, dtype, naive)
            for reduction in ("token", "sequence")
            for dtype in (torch.float32, torch.float64)
        }
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


if __name__ == "__main__":
    # equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH [naive]; LAYOUTS: DP_REPLICATExDP_SHARD[,...], e.g. 2x1,1x2
    out, layouts, micro, *rest = sys.argv[1:]
    results = run_layouts([tuple(int(x) for x in layout.split("x")) for layout in layouts.split(",")], int(micro),
                          naive=bool(rest))
    if results is not None:
        torch.save(results, out)
