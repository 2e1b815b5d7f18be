"""The RL loss of one micro-batch, and the token statistics logged with it.

Per response token t (all algorithms; terms switched off by their settings):

    ℓ_t = w_t · policy_loss_t(π / π_old, A_t) + kl_coef · KL_t − entropy_coef · H_t

where w_t is rl.rollout_correction's detached weight of the engine–trainer mismatch (rl/mismatch.py; 1 without
one, 0 on a dropped token), and π_old is the trainer's log-probs of the behaviour policy — recomputed when a rollout
feeds several optimizer steps, else the current policy's own (ratio 1) — or, with `bypass`, the engine's.
and the mini-batch loss is Σ_{ranks, micro-batches} Σ_t a_t ℓ_t / D, where (a_t, D) come from
`aggregation_weights` for `rl.loss_agg` and D is summed over every rank and micro-batch *before*
any backward — the same global normalisation as SFT, so the loss and gradient of every
aggregation mode do not depend on the DP size or the micro-batch size (invariant 1).
Under context parallelism (rl/pieces.py) each CP rank computes Σ_t a_t ℓ_t and the statistics of its piece of
every row, summed over CP; a_t, D and the sequence-level correction weights come from the whole rows.
Logged statistics are token sums over the same global mini-batch, divided once; the mismatch figures compare
the engine with the trainer's π_old (with `bypass` and no recomputed π_old: with the policy being updated, which
is π_old on a rollout's first optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.config import RLConfig
from isotrain.moe.objective import RouterStep
from isotrain.moe.routing import input_token_mask
from isotrain.rl.algos import (
    aggregation_weights,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
)
from isotrain.rl.experience import forward_output
from isotrain.rl.mismatch import correction_weights, logprob_gap
from isotrain.rl.pieces import NO_CP, Pieces

# Token sums all-reduced with every mini-batch; divided by "tokens" when logged. The last five measure the
# engine–trainer mismatch (rl/mismatch.py): |Δ|, exp|Δ|, k3, the correction's weight and its dropped tokens.
STAT_NAMES = ("tokens", "pg_loss", "clipped", "kl", "entropy", "rollout_logprob_diff", "token_mult_prob_error",
              "rollout_kl", "correction_weight", "correction_masked")


@dataclass(frozen=True)
class RLObjective:
    rl: RLConfig
    pieces: Pieces = NO_CP  # context parallelism: the loss of this rank's piece of every row (rl/pieces.py)

    @property
    def norm_length(self) -> int:
        return self.rl.max_new_tokens

    @property
    def kl_in_loss(self) -> bool:
        return self.rl.kl_coef > 0 and not self.rl.kl_in_reward

    def weights(self, mb: dict, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """(a_t [rows, L], D) of a micro-batch, per sample whether its rows are padded or packed."""
        mask, ids = mb["mask"], mb["sequence_ids"]
        if device is not None:
            mask, ids = mask.to(device), ids.to(device)
        return aggregation_weights(mask, self.rl.loss_agg, self.norm_length, ids)

    def denominator(self, mb: dict) -> float:
        return self.weights(mb)[1]

    def correction(self, trainer_old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                   sequence_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(w [rows, L] or None without a weighting correction, dropped [rows, L] bool) of rl.rollout_correction;
        per sequence of packed rows (its `sequence_ids`), so the same in any layout."""
        rl = self.rl
        if rl.correction in (None, "bypass"):
            return None, torch.zeros_like(mask, dtype=torch.bool)
        return correction_weights(rl.correction, trainer_old, engine, mask, sequence_ids, rl.correction_cap,
                                  rl.rollout_mask_low, rl.rollout_mask_high)

    def _piece_correction(self, mb: dict, logp: torch.Tensor, device: torch.device):
        """`correction` of the whole rows of `mb` (a sequence-level weight sums Δ_t over whole sequences), cut to
        this CP rank's piece. π_old is the rollout's, or (on-policy) the policy's own log-probs `logp` of the
        piece, gathered over CP."""
        pieces = self.pieces
        if self.rl.correction in (None, "bypass"):
            return None, torch.zeros_like(logp, dtype=torch.bool)
        length = mb["input_ids"].shape[1]
        old = mb["old_logprobs"].to(device) if mb.get("old_logprobs") is not None \
            else pieces.whole(logp.detach(), length)
        weight, dropped = self.correction(old, mb["engine_logprobs"].to(device), mb["mask"].to(device),
                                          mb["sequence_ids"].to(device))
        return pieces.cut_tensor(weight), pieces.cut_tensor(dropped, False)

    def loss_sum(self, model, mb: dict, autocast, device: torch.device, stats: torch.Tensor,
                 router: RouterStep | None = None, index: int | None = None):
        """Σ_t a_t ℓ_t of one micro-batch (of this CP rank's piece of its rows under context parallelism: the
        pieces' sums add up to the rows' over CP); adds its token statistics into `stats` (float64, STAT_NAMES
        order). With `router` (an MoE policy): (that sum, the router term of micro-batch `index`, whose pool is
        every real prompt + response token), as train/step.py's `_backpropagate` takes them."""
        rl = self.rl
        whole_weights, _ = self.weights(mb, device)  # per sequence: from whole rows, then cut
        piece, cut = self.pieces.cut(mb, {"weights": whole_weights})
        weights, mask = cut["weights"], piece["mask"].to(device)
        with autocast:
            output = forward_output(model, piece, device, router_logits=router is not None)
        logits = output.logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / rl.temperature
        logp = token_logprobs(logits, piece["targets"].to(device))
        # On-policy (one optimizer step per rollout): the old policy is the current one, ratio = 1.
        trainer_old = piece["old_logprobs"].to(device) if piece.get("old_logprobs") is not None else logp.detach()
        engine = piece["engine_logprobs"].to(device)
        old = engine if rl.correction == "bypass" else trainer_old
        pg, clipped = policy_loss(logp, old, piece["advantages"].to(device), rl.clip_low, rl.clip_high, rl.dual_clip)
        weight, dropped = self._piece_correction(mb, logp, device)
        if weight is not None:
            pg = pg * weight
        loss = pg
        kl = torch.zeros_like(logp)
        if piece.get("ref_logprobs") is not None:
            kl = kl_penalty(logp, piece["ref_logprobs"].to(device), rl.kl_estimator, rl.kl_clip)
            if self.kl_in_loss:
                loss = loss + rl.kl_coef * kl
        entropy_needed = rl.entropy_coef > 0
        with torch.set_grad_enabled(entropy_needed and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_needed else logits.detach())
        if entropy_needed:
            loss = loss - rl.entropy_coef * entropy
        on = mask > 0
        with torch.no_grad():
            stats += _token_sums(on, pg, clipped, kl, entropy, logprob_gap(trainer_old, engine), weight, dropped)
        weighted_sum = torch.where(on, loss * weights, 0.0).sum()
        if router is None:
            return weighted_sum
        return weighted_sum, router.term(output.router_logits, input_token_mask(piece["segment_ids"].to(device)),
                                         index)


def _token_sums(on: torch.Tensor, pg, clipped, kl, entropy, gap: tuple, weight, dropped) -> torch.Tensor:
    """STAT_NAMES' sums over the response tokens `on` of one micro-batch, in fp64: the GRPO loss cancels to ~0, so
    fp32 sums would be noise. Without a weighting correction the weight sum is 0 (it is not logged then)."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.where(on, x, 0.0).double().sum()

    def count(x: torch.Tensor) -> torch.Tensor:
        return (x & on).sum().double()

    no_weight = torch.zeros((), dtype=torch.float64, device=on.device)
    return torch.stack([count(on), total(pg), count(clipped), total(kl), total(entropy), *(total(x) for x in gap),
                        total(weight) if weight is not None else no_weight, count(dropped)])
