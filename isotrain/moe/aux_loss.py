"""The load-balancing (aux) loss of transformers' `load_balancing_loss_func`, split so that any token pool works.

For a pool of N input tokens routed through L MoE layers to E experts (top-k):

    f_e = Σ_l C_le / (N·L)        token fraction (counts; no gradient)
    P_e = Σ_l S_le / (N·L)        mean router probability (S_le = Σ_t p_le(t); gradient flows through it)
    aux = E · Σ_e f_e · P_e

Every layer's tokens are pooled, as transformers does. The pool is the scope (docs/moe.md):
  micro_batch: each micro-batch is a pool; the objective takes the mean over the M micro-batches of all ranks.
  global:      the whole global batch is one pool. P_e is linear in each token's probabilities, so with the
               global f_e and N known, aux = Σ_mb E · Σ_e f_e · S_mb_e / (N·L): every micro-batch backpropagates
               its exact share, and the sum — value and gradient — does not depend on the split.
"""

from __future__ import annotations

import torch


def aux_loss_part(pool_counts: torch.Tensor, local_prob_sums: torch.Tensor, pool_tokens: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
    """E · Σ_e f_e · (Σ_l S_le) / (N·L): the share of aux that the tokens behind `local_prob_sums` carry.

    pool_counts int64 [L, E] and pool_tokens (N) of the pool; local_prob_sums fp32 [L, E] of this forward's
    tokens (a subset of the pool, or the pool itself). With local = pool it is the whole aux of the pool."""
    num_layers = pool_counts.shape[0]
    dtype = local_prob_sums.dtype  # fp32, or fp64 for an fp64 model
    rows = pool_tokens.to(dtype).clamp_min(1) * num_layers  # N·L
    fractions = pool_counts.sum(0).to(dtype) / rows
    return num_experts * (fractions * local_prob_sums.sum(0)).sum() / rows


def z_loss_part(local_z_sum: torch.Tensor, pool_tokens: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Σ_l Σ_t logsumexp² / (N·L): the router z-loss (mean over the pool's tokens and the MoE layers) share of
    the tokens behind `local_z_sum`."""
    return local_z_sum / (pool_tokens.to(local_z_sum.dtype).clamp_min(1) * num_layers)
