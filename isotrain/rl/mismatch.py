"""The rollout engine–trainer mismatch: what is measured every step and the corrections, as pure tensor functions.

The engine samples a response y with its own kernels and precision, so its log-probs log π_engine(y_t) differ
from the trainer's log π_old(y_t) of the same weights (and, in asynchronous RL, of stale weights). With

    Δ_t = log π_old(y_t) - log π_engine(y_t)          ρ_t = exp(Δ_t) = π_old / π_engine   (per response token)

a correction reweights the policy-gradient term of every token by a detached constant w_t (0 drops the token),
so that samples drawn from π_engine estimate the gradient under π_old. Nothing here knows about models, configs or
torch.distributed; shapes as in algos.py (B rows, T tokens, `mask` nonzero on the response tokens that count).

Sequence-level quantities are sums over the unmasked tokens of one sequence, found by `sequence_ids` [B, T] when
rows are packed (several sequences per row); a sequence is never split across rows or ranks, so every weight
depends on its own sequence alone, whatever the micro-batch or DP layout. Log-ratios and their sums are taken in
fp64 and compared with the bounds in log space: no product of ratios is ever formed, and a sequence is kept or
dropped the same way in any layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from isotrain.rl.algos import kl_k3, sequence_totals, truncated_is_weights

# rl.rollout_correction's values. "bypass" has no weight: it takes the engine's log-probs as π_old (objective.py).
CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis", "geo_rs", "bypass")
CAPPED = ("token_tis", "seq_tis")  # read rl.rollout_is_cap
MASKING = ("token_mis", "seq_mis", "geo_rs")  # read rl.rollout_mask_low / rl.rollout_mask_high


def sequence_sums(values: Tensor, mask: Tensor, sequence_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(Σ v, n) over the unmasked tokens of each token's sequence, broadcast back to its tokens: [B, T] each, fp64.

    sequence_ids [B, T] (int >= 0) names the sequence of every token of packed rows; default: its row. Masked
    positions add nothing (their values may be garbage, their ids are ignored)."""
    m = mask if mask.dtype == torch.bool else mask != 0
    v = torch.where(m, values.double(), 0.0)
    if sequence_ids is None:
        return v.sum(-1, keepdim=True).expand_as(v), m.sum(-1, keepdim=True).double().expand_as(v)
    sums, ids = sequence_totals(v, sequence_ids)
    counts, _ = sequence_totals(m.double(), sequence_ids)
    return sums[ids], counts[ids]


def _log_bound(ratio: float) -> float:
    return math.log(ratio) if ratio > 0 else -math.inf  # a lower bound of 0 keeps every small ratio


def correction_weights(mode: str, trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor,
                       sequence_ids: Tensor | None = None, cap: float | None = None, low: float | None = None,
                       high: float | None = None) -> tuple[Tensor, Tensor]:
    """(w [B, T], dropped [B, T] bool) of a correction; w is detached, 0 where masked or dropped. With
    Δ_t = log π_old - log π_engine, S = Σ_{t ∈ seq} Δ_t and n = the sequence's token count:

        token_tis   w_t = min(ρ_t, cap)                                     token-level truncated IS
        seq_tis     w_t = min(exp S, cap) = exp(min(S, log cap))            sequence-level truncated IS
        token_mis   w_t = ρ_t     if low <= ρ_t <= high,        else 0      token-level masked IS
        seq_mis     w_t = exp S   if low <= exp S <= high,      else 0      sequence-level masked IS
        geo_rs      w_t = 1       if low <= exp(S / n) <= high, else 0      geometric-mean rejection

    `dropped` marks the tokens a masking mode (token_mis, seq_mis, geo_rs) sets to 0; never for the others.
    """
    m = mask if mask.dtype == torch.bool else mask != 0
    out_dtype = torch.promote_types(trainer_logprobs.dtype, torch.float32)
    nothing = torch.zeros_like(m)
    if mode not in CORRECTIONS or mode == "bypass":
        raise ValueError(f"Unknown correction {mode!r}; valid weighting modes are: "
                         f"{', '.join(c for c in CORRECTIONS if c != 'bypass')}.")
    if mode in CAPPED and (cap is None or cap <= 0):
        raise ValueError(f"cap must be positive, got {cap}.")
    if mode == "token_tis":
        return truncated_is_weights(trainer_logprobs, engine_logprobs, m, cap), nothing
    delta = torch.where(m, trainer_logprobs.detach().double() - engine_logprobs.detach().double(), 0.0)
    if mode == "seq_tis":
        total, _ = sequence_sums(delta, m, sequence_ids)
        # exp after the min: exp(S) of a long sequence overflows long before the cap bounds it.
        return torch.where(m, torch.exp(total.clamp(max=math.log(cap))), 0.0).to(out_dtype), nothing
    if low is None or high is None or not 0 <= low < high:
        raise ValueError(f"bounds must satisfy 0 <= low < high, got low={low}, high={high}.")
    log_low, log_high = _log_bound(low), math.log(high)
    if mode == "token_mis":
        stat = delta
    else:
        total, count = sequence_sums(delta, m, sequence_ids)
        stat = total if mode == "seq_mis" else total / count.clamp_min(1)
    kept = (stat >= log_low) & (stat <= log_high)
    # Inside the bounds exp(stat) <= high: no overflow.
    value = torch.ones_like(stat) if mode == "geo_rs" else torch.exp(torch.where(kept, stat, 0.0))
    return torch.where(m & kept, value, 0.0).to(out_dtype), m & ~kept


def logprob_gap(trainer_logprobs: Tensor, engine_logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token measures of the mismatch, [B, T] each, fp64, with Δ = log π_trainer - log π_engine:

        |Δ|                        rollout_logprob_diff
        exp|Δ| = max(ρ, 1/ρ)       token_mult_prob_error (NeMo RL's figure: 1 when they agree)
        k3 = e^Δ - Δ - 1 >= 0      rollout_kl: on tokens the engine sampled, E[k3] = KL(π_engine || π_trainer)

    (k3 clamps Δ to ±20 as the KL term does.) The caller selects the response tokens and sums."""
    delta = trainer_logprobs.detach().double() - engine_logprobs.detach().double()
    gap = delta.abs()
    return gap, torch.exp(gap), kl_k3(engine_logprobs.detach().double(), trainer_logprobs.detach().double())
