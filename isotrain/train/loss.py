"""Token losses and their global normalisation (invariant 1).

For a global batch B split over DP ranks r and micro-batches m:

    token reduction:     L = Σ_{r,m} Σ_t ℓ_t  /  T,        T = Σ_{r,m} #trained tokens
    sequence reduction:  L = Σ_{r,m} Σ_t ℓ_t / n_{s(t)} / S,  S = Σ_{r,m} #sequences with a trained token

where n_s is the number of trained tokens of sequence (document) s. T and S are all-reduced over
DP *before* any backward, so each micro-batch backpropagates its share of the global mean and the
summed gradient does not depend on how B was split. The naive alternative — mean per micro-batch,
then mean over micro-batches and ranks — weights a token by 1/(its micro-batch's token count) and
so changes with the layout whenever micro-batches hold different numbers of trained tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy in at least fp32 (fp64 stays fp64), 0 where labels == -100. logits [B, L, V], labels [B, L] (pre-shifted).

    Logits sharded over the vocabulary (a TP DTensor) need the caller's `loss_parallel()` context: each
    rank then computes its part of the log-sum-exp and the target logit, and the per-token losses come
    back whole on every rank."""
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    if isinstance(flat, DTensor):
        flat = flat.full_tensor()
    return flat.view(labels.shape)


def loss_weights(labels: torch.Tensor, segment_ids: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights and this micro-batch's contribution to the global denominator (an int64 scalar on
    the labels' device: reading it is the caller's choice, so the training forward never waits on the device).

    token:    weight 1 per trained token; denominator = #trained tokens.
    sequence: weight 1/n_s per trained token of sequence s; denominator = #sequences with n_s > 0.
    """
    trained = labels != IGNORE_INDEX
    if reduction == "token":
        return trained.float(), trained.sum()
    # Give every (row, segment) pair one id, count its trained tokens, and spread 1/n_s back.
    num_segments = max(labels.shape[-1], 1)  # a row holds at most one segment per position; no device read
    row_offset = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1) * num_segments
    keys = torch.where(trained, segment_ids + row_offset, 0).reshape(-1)
    counts = torch.zeros(labels.shape[0] * num_segments, device=labels.device)
    counts.scatter_add_(0, keys, trained.reshape(-1).float())
    per_token = counts[keys].view(labels.shape)
    weights = torch.where(trained, 1.0 / per_token.clamp_min(1.0), 0.0)
    return weights, (counts > 0).sum()


def micro_batch_counts(mb: dict, reduction: str) -> list[int]:
    """[input tokens, trained tokens, loss denominator, samples] of one collated micro-batch (data/collate.py), or
    the `counts` it was given (a middle pipeline stage's micro-batch: train/stage_data.py)."""
    if "counts" in mb:
        return list(mb["counts"])
    _, denominator = loss_weights(mb["labels"], mb["segment_ids"], reduction)  # host tensors: no device wait
    return [mb["num_input_tokens"], mb["num_trained_tokens"], int(denominator), mb["input_ids"].shape[0]]
