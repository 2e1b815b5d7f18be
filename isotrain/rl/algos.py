"""RL estimators and losses as pure tensor functions (in the spirit of verl's core_algos.py).

Nothing here knows about models, configs or torch.distributed: every function maps tensors to
tensors, with shapes in its docstring, and the names a config may use are the keys of
ADVANTAGE_ESTIMATORS, KL_ESTIMATORS and LOSS_AGG_MODES.

Conventions: B = rows (samples), T = response tokens, V = vocabulary; `mask` is [B, T], nonzero on
the response tokens that count. Masked positions of any input may hold garbage (even inf/NaN):
they are selected away with torch.where, never multiplied by 0, so they cannot leak into a result.
Reductions run in at least fp32 (fp64 stays fp64); a row, group or batch with nothing in it gives
0, never NaN.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {}
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Group estimators take (rewards [G, n], norm_std, eps); the token-level ones ("reinforce_pp",
# "gae") have their own signatures below, because they need per-token rewards (and values).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")

# exp() of a log-ratio beyond ±20 is 5e8 / 2e-9: already meaningless, and beyond ~88 it is inf in
# fp32, which turns 0 * ratio into NaN. Both PPO's ratio and k3 clamp the log-ratio here.
_MAX_LOG_RATIO = 20.0


def _register(registry: dict, name: str):
    def decorate(fn):
        registry[name] = fn
        return fn

    return decorate


def _lookup(registry: dict, name: str, what: str) -> Callable:
    if name not in registry:
        raise ValueError(f"Unknown {what} {name!r}; valid names are: {', '.join(sorted(registry))}.")
    return registry[name]


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 stays fp64; bf16/fp16/integers are computed in fp32."""
    return torch.promote_types(x.dtype, torch.float32)


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# ----------------------------------------------------------------------------- masked statistics


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_{mask} v / #mask over all positions (any shape); 0 for an all-masked input. Returns a scalar."""
    m = _as_bool(mask)
    v = values.to(_compute_dtype(values))
    return torch.where(m, v, 0).sum() / m.sum().clamp_min(1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(v - mean) / (std + eps) with mean and unbiased std over the unmasked positions; 0 where masked.

    The variance uses Bessel's correction n/(n-1) like torch.std (and verl); with fewer than two
    unmasked values it is taken as 0, so the result is (v - v)/eps = 0 rather than NaN.
    """
    m = _as_bool(mask)
    v = values.to(_compute_dtype(values))
    mean = masked_mean(v, m)
    centered = torch.where(m, v - mean, 0)
    num = m.sum()
    var = (centered**2).sum() / (num - 1).clamp_min(1)
    return torch.where(m, centered / (var.sqrt() + eps), 0)


# ----------------------------------------------------------------------------- group (outcome) advantages


def _centered(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rewards in fp64, r - group mean, constant-group mask [G, 1]).

    Work in fp64: with an eps of 1e-6 in the denominator, an fp32 rounding error of 1e-8 in the
    mean would become a 1% advantage. A group whose rewards are all equal (including a group of
    one) carries no learning signal, so its centred reward is set to exactly 0: the fp mean of n
    equal numbers need not equal them.
    """
    if rewards.dim() != 2 or rewards.shape[-1] < 1:
        raise ValueError(f"rewards must have shape [num_groups, group_size >= 1], got {tuple(rewards.shape)}.")
    r = rewards.to(torch.float64)
    constant = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)
    centered = torch.where(constant, 0.0, r - r.mean(-1, keepdim=True))
    return r, centered, constant


@_register(ADVANTAGE_ESTIMATORS, "grpo")
def grpo_advantages(rewards: Tensor, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), std unbiased (torch.std default, as in verl).

    rewards [G, n] -> [G, n]. With norm_std=False this is r_i - mean_g. n = 1 gives 0.
    """
    r, centered, constant = _centered(rewards)
    if norm_std and r.shape[-1] > 1:
        std = torch.where(constant, 0.0, r.std(-1, keepdim=True))
        centered = centered / (std + eps)
    return centered.to(_compute_dtype(rewards))


@_register(ADVANTAGE_ESTIMATORS, "dr_grpo")
def dr_grpo_advantages(rewards: Tensor, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g, never divided by the std (which biases towards groups with
    low reward variance, i.e. too easy or too hard prompts). rewards [G, n] -> [G, n];
    norm_std and eps are accepted for a common signature and ignored."""
    return _centered(rewards)[1].to(_compute_dtype(rewards))


@_register(ADVANTAGE_ESTIMATORS, "rloo")
def rloo_advantages(rewards: Tensor, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """RLOO: A_i = r_i - mean_{j≠i} r_j = n/(n-1) (r_i - mean_g): the leave-one-out baseline
    does not depend on the sample's own reward, so the estimator stays unbiased.
    rewards [G, n] -> [G, n]; n = 1 has no other sample to compare with and gives 0.
    norm_std and eps are ignored."""
    _, centered, _ = _centered(rewards)
    n = rewards.shape[-1]
    scale = n / (n - 1) if n > 1 else 0.0
    return (scale * centered).to(_compute_dtype(rewards))


@_register(ADVANTAGE_ESTIMATORS, "reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: Tensor, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: a_i = r_i - mean_g, then whitened over the whole batch (every group):
    A = (a - mean(a)) / (std(a) + eps), std unbiased. The group mean removes the prompt's
    difficulty; the global std keeps the scale stable without GRPO's per-group std bias.
    rewards [G, n] -> [G, n]. norm_std is ignored. Constant groups stay exactly 0."""
    _, centered, constant = _centered(rewards)
    whitened = masked_whiten(centered, torch.ones_like(centered, dtype=torch.bool), eps)
    return torch.where(constant, 0.0, whitened).to(_compute_dtype(rewards))


def group_advantages(name: str, rewards: Tensor, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Outcome advantages for group estimators; rewards [num_groups, group_size] -> [num_groups, group_size]
    (one scalar per sample, to be broadcast over its response tokens)."""
    if name not in GROUP_ESTIMATORS:
        hint = " (token-level: call reinforce_pp_advantages / gae_advantages)" if name in ADVANTAGE_ESTIMATORS else ""
        raise ValueError(
            f"Unknown group advantage estimator {name!r}{hint}; valid names are: {', '.join(GROUP_ESTIMATORS)}."
        )
    return ADVANTAGE_ESTIMATORS[name](rewards, norm_std=norm_std, eps=eps)


# ----------------------------------------------------------------------------- token-level advantages
#
# Masked positions inside a response (e.g. tool output in a multi-turn rollout) are transparent:
# they add no reward and are not a discount step, so the credit of a later reward flows back
# through them. For the usual contiguous mask this is exactly the textbook recursion.


def token_level_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ returns: G_t = Σ_{k>=t} γ^(k-t) r_k over the response tokens.

    token_rewards, mask [B, T] -> [B, T], 0 where mask == 0. Computed right to left:
    G_t = r_t + γ G_{t+1}, where G_{t+1} is the return at the next *unmasked* token (0 after the last).
    """
    m = _as_bool(mask)
    r = token_rewards.to(_compute_dtype(token_rewards))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, 0)
    return returns


@_register(ADVANTAGE_ESTIMATORS, "reinforce_pp")
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: the returns G_t whitened over every unmasked token of the batch (masked mean and
    unbiased std). token_rewards, mask [B, T] -> [B, T], 0 where masked."""
    return masked_whiten(token_level_returns(token_rewards, mask, gamma), mask, eps)


@_register(ADVANTAGE_ESTIMATORS, "gae")
def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """PPO's generalised advantage estimation over the response tokens.

    token_rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]), 0 where masked.
        δ_t = r_t + γ V_{t+1} - V_t          (V after the last unmasked token = 0: the episode ends)
        A_t = δ_t + γ λ A_{t+1}              (= Σ_k (γλ)^k δ_{t+k})
        R_t = A_t + V_t                      (the value target, a λ-return)
    Advantages are not whitened here; callers use masked_whiten(advantages, mask) if they want it.
    """
    m = _as_bool(mask)
    dtype = torch.promote_types(_compute_dtype(token_rewards), _compute_dtype(values))
    r, v = token_rewards.to(dtype), values.to(dtype)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_advantage = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(m[:, t], v[:, t], next_value)
        next_advantage = torch.where(m[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(m[:, t], advantage, 0)
    returns = torch.where(m, advantages + v, 0)
    return advantages, returns


# ----------------------------------------------------------------------------- KL estimators
#
# With x = log π_ref(y) - log π(y) and y ~ π:  k1 = -x (unbiased, high variance, can be < 0);
# k2 = x²/2 (biased, low variance; its gradient is that of KL for small x);
# k3 = e^x - x - 1 (Schulman's unbiased, low-variance estimator, always >= 0 since e^x >= 1 + x).


@_register(KL_ESTIMATORS, "k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


@_register(KL_ESTIMATORS, "k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


@_register(KL_ESTIMATORS, "k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, clip: float | None = None) -> Tensor:
    x = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # expm1(x) - x rather than exp(x) - x - 1: for small x the latter cancels to a slightly
    # negative number in fp32, while a faithfully rounded expm1(x) >= x keeps k3 >= 0.
    k3 = torch.expm1(x) - x
    # Unbounded, one token the policy made e^20 times less likely than the reference would dominate the loss.
    return k3 if clip is None else k3.clamp(max=clip)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clip: float | None = None) -> Tensor:
    """Per-token estimate of KL(π || π_ref) from log-probs of the sampled tokens; [B, T], [B, T] -> [B, T].
    `clip` (rl.kl_clip) bounds k3 from above."""
    fn = _lookup(KL_ESTIMATORS, estimator, "KL estimator")
    return fn(logprobs, ref_logprobs, clip) if estimator == "k3" else fn(logprobs, ref_logprobs)


# ----------------------------------------------------------------------------- losses


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and a bool 'clipped' mask, both [B, T]; advantages [B, 1] or [B, T].

        ρ = exp(log π - log π_old)
        ℓ = max(-A ρ, -A clamp(ρ, 1 - clip_low, 1 + clip_high))     (clip-higher if clip_high > clip_low)
        dual clip (c > 1), for A < 0 only:  ℓ = min(ℓ, -A c)
    The max is the pessimistic bound: the ratio may move the loss down only inside the trust
    region. Dual clip bounds the loss of a negative-advantage token whose ratio has exploded.
    'clipped' marks tokens where a constant branch was taken, i.e. whose gradient is zero.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be greater than 1 (or None to disable it), got {dual_clip}.")
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # torch.where (not torch.maximum) so the gradient goes wholly to the branch that was taken.
    clipped = clipped_loss > unclipped_loss
    loss = torch.where(clipped, clipped_loss, unclipped_loss)
    if dual_clip is not None:
        dual_loss = -advantages * dual_clip
        dual = (advantages < 0) & (dual_loss < loss)
        loss = torch.where(dual, dual_loss, loss)
        clipped = clipped | dual
    return loss, clipped


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Per-token value loss [B, T]: 0.5 max((V - R)², (clamp(V, V_old - c, V_old + c) - R)²).

    Like the policy clip, the max keeps the pessimistic of the moved and the clipped value, so
    one update cannot move V far from V_old to chase a noisy return. clip None: 0.5 (V - R)².
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped_values = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
        loss = torch.maximum(loss, (clipped_values - returns) ** 2)
    return 0.5 * loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, [B, T, V] -> [B, T], in fp32 (fp64 logits: fp64).

    H = -Σ p log p = logsumexp(z) - Σ p z, which never takes log of a tiny probability. H does not
    change when z shifts, so z - max(z) keeps both terms small (at logits ~1e4 the fp32 spacing
    of logsumexp alone is 1e-3).
    """
    z = logits.to(_compute_dtype(logits))
    z = z - z.amax(-1, keepdim=True).detach()
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at token_ids; [B, T, V], [B, T] -> [B, T] fp32 (fp64 logits: fp64).

    The temperature must be the one the rollout sampled with, or the ratio to the engine's
    log-probs is off from the first step. Computed as z[y] - logsumexp(z): no [B, T, V] log-softmax.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    z = logits.to(_compute_dtype(logits)) / temperature
    z = z - z.amax(-1, keepdim=True).detach()  # log-softmax is shift-invariant; keeps logsumexp exact
    picked = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def truncated_is_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling between the rollout engine and the trainer, [B, T] -> [B, T].

    w = min(π_trainer / π_engine, cap) = min(exp(log π_trainer - log π_engine), cap); 0 where masked;
    detached (a constant weight on the token loss). The engine (e.g. vLLM, other kernels or
    precision) samples from a slightly different distribution than the trainer computes; the
    weight corrects that bias and the cap bounds its variance.
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}.")
    m = _as_bool(mask)
    log_ratio = (trainer_logprobs.detach() - engine_logprobs.detach()).to(_compute_dtype(trainer_logprobs))
    return torch.where(m, torch.exp(log_ratio).clamp(max=cap), 0)


# ----------------------------------------------------------------------------- loss aggregation
#
# A batch (split into parts p: micro-batches and DP ranks, always along whole rows) gives
#
#     L = Σ_p Σ_{b,t ∈ p} w_bt ℓ_bt  /  Σ_p D_p
#
# with n_b = Σ_t m_bt the row's unmasked tokens and R = #{b : n_b > 0}:
#     token-mean:               w = m,        D = Σ_b n_b          L = Σ ℓ m / #tokens
#     seq-mean-token-sum:       w = m,        D = R                L = mean_b Σ_t ℓ
#     seq-mean-token-mean:      w = m / n_b,  D = R                L = mean_b mean_t ℓ
#     seq-mean-token-sum-norm:  w = m,        D = R · norm_length  L = mean_b Σ_t ℓ / norm_length (Dr. GRPO)
# Each w_bt depends on its own row only and each D is a sum over rows, so Σ_p D_p is the whole
# batch's D and L (and ∂L/∂ℓ = w / ΣD) do not depend on the split. The caller must all-reduce
# the D_p before dividing; a mean of per-part means would weight rows by their part's size.
# Dr. GRPO's norm_length is a constant (e.g. max_new_tokens) so that a long answer is not
# down-weighted per token as it is in seq-mean-token-mean. All-masked rows contribute 0 and
# count in no denominator.
#
# "Row" means sequence: with several sequences packed into one row, `sequence_ids` [B, T] names the
# sequence of every token, and n_b, R count per sequence, so a packed batch gets the very weights and
# D of the same sequences padded one per row (n_b is the same integer, so w = m / n_b is bit-identical).


def sequence_totals(values: Tensor, sequence_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ values per sequence [S], ids [B, T]) for packed rows: sequence_ids [B, T] (int, >= 0) names each token's
    sequence and `totals[ids]` broadcasts the sums back to the tokens. Masked tokens must carry a value of 0 (their
    ids are then harmless; negative ids count as 0)."""
    ids = sequence_ids.long().clamp_min(0)
    num_sequences = int(ids.max()) + 1 if ids.numel() else 0
    totals = torch.zeros(num_sequences, dtype=values.dtype, device=values.device)
    return totals.index_add_(0, ids.flatten(), values.flatten()), ids


def aggregation_weights(mask: Tensor, mode: str, norm_length: int | None = None,
                        sequence_ids: Tensor | None = None) -> tuple[Tensor, float]:
    """Per-token weights w [B, T] and this batch's contribution D to the loss denominator (see above).

    w has the mask's dtype if it is floating, else fp32. norm_length is required by
    'seq-mean-token-sum-norm' and ignored by the other modes. sequence_ids [B, T] (int, >= 0): the
    sequence each token belongs to, for packed rows; default: its row. Ids of masked tokens are ignored.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}; valid modes are: {', '.join(LOSS_AGG_MODES)}.")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T], got {tuple(mask.shape)}.")
    m = _as_bool(mask)
    w = m.to(mask.dtype if mask.dtype.is_floating_point else torch.float32)
    if sequence_ids is None:
        tokens_per_sequence = m.sum(-1)
        tokens_at = tokens_per_sequence.unsqueeze(-1)  # n_b of each token's sequence, broadcast over T
    else:
        if sequence_ids.shape != mask.shape:
            raise ValueError(f"sequence_ids must have the mask's shape {tuple(mask.shape)}, "
                             f"got {tuple(sequence_ids.shape)}.")
        tokens_per_sequence, ids = sequence_totals(m.long(), sequence_ids)
        tokens_at = tokens_per_sequence[ids]
    num_rows = float((tokens_per_sequence > 0).sum())
    if mode == "token-mean":
        return w, float(tokens_per_sequence.sum())
    if mode == "seq-mean-token-sum":
        return w, num_rows
    if mode == "seq-mean-token-mean":
        return w / tokens_at.clamp_min(1).to(w.dtype), num_rows
    if norm_length is None or norm_length <= 0:
        raise ValueError(
            f"Loss aggregation 'seq-mean-token-sum-norm' needs a positive norm_length "
            f"(a constant such as max_new_tokens), got {norm_length}."
        )
    return w, num_rows * norm_length


def aggregate(token_loss: Tensor, mask: Tensor, mode: str, norm_length: int | None = None) -> Tensor:
    """Σ w ℓ / max(D, 1) over one whole batch; token_loss, mask [B, T] -> scalar (0 if all masked)."""
    w, denominator = aggregation_weights(mask, mode, norm_length)
    weighted = torch.where(_as_bool(mask), w * token_loss, 0)
    return weighted.sum() / max(denominator, 1.0)


# ----------------------------------------------------------------------------- reward shaping


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment per sample, lengths [B] -> [B] fp32 (fp64 if given fp64):

        0                                   if L <= max_length - buffer
        ((max_length - buffer) - L) / buffer  if max_length - buffer < L <= max_length   (linear, 0 to -1)
        -1                                  if L > max_length
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer}.")
    length = lengths.to(_compute_dtype(lengths))
    start = max_length - buffer
    ramp = (start - length) / buffer
    return torch.where(length <= start, 0.0, torch.where(length <= max_length, ramp, -1.0))
