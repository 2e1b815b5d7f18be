"""The options of a training step (StepOptions) and the contexts every step path opens from them.

They live below train/step.py so that its pipeline path (train/pipeline_step.py), which step.py calls, shares them
without importing step.py back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from isotrain.moe.settings import RouterSettings
from isotrain.parallel.pp import Pipeline


@dataclass(frozen=True)
class StepOptions:
    loss_reduction: str = "token"
    grad_clip: float = 0.0
    autocast_dtype: torch.dtype | None = None  # set for bf16 without FSDP (which casts itself)
    dp_group: object = None  # counts and losses are summed over it; None only without a process group
    loss_parallel: bool = False  # TP: logits arrive sharded over the vocabulary
    parallel: object = None  # the run's ParallelState (TP × DDP gradient sums)
    document_mask: bool = False  # packed batches get isotrain's per-document mask (models/packing_check.py)
    router: RouterSettings | None = None  # MoE models: the router terms of the objective (isotrain/moe/)
    loss_chunk_tokens: int = 0  # > 0: the cross-entropy over chunks of this many tokens (train/chunked_loss.py)
    compile_loss: bool = False  # train.compile: the chunked loss's chunks are compiled too
    pipeline: Pipeline | None = None  # parallel.pp: this rank's stage and schedules, kept across steps


def loss_parallel_context(options: StepOptions):
    """Vocabulary-parallel cross-entropy (TP: the logits arrive sharded over the vocabulary), or nothing."""
    if not options.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def autocast_context(options: StepOptions, device: torch.device):
    """bf16 autocast without FSDP (FSDP2 casts itself), or nothing."""
    if options.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=options.autocast_dtype)
