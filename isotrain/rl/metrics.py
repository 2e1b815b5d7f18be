"""The metrics row of one RL step, from its rollout, its updates and its timings."""

from __future__ import annotations

import torch

from isotrain.moe.metrics import router_metrics
from isotrain.rl.mismatch import MASKING
from isotrain.rl.update import UpdateTotals


def mismatch_metrics(totals: UpdateTotals, correction: str | None) -> dict:
    """The engine–trainer mismatch as token means over every optimizer step of the rollout (rl/mismatch.py), and
    for a weighting correction the mean weight, for a masking one also the share of tokens it dropped."""
    row = {name: totals.stat(name) for name in ("rollout_logprob_diff", "token_mult_prob_error", "rollout_kl")}
    if correction not in (None, "bypass"):
        row["rollout_is_weight_mean"] = totals.stat("correction_weight")
    if correction in MASKING:
        row["rollout_masked_frac"] = totals.stat("correction_masked")
    return row


def rl_metrics_row(counters: dict, batch, rounds, totals: UpdateTotals, with_critic: bool, step_s: float,
                   timings: dict, correction: str | None = None) -> dict:
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    return {
        "loss": totals.loss_sum / totals.num_updates,
        "lr": totals.lr,
        "grad_norm": totals.grad_norm_sum / totals.num_updates,
        **{k: counters[k] for k in ("tokens_seen", "trained_tokens", "samples_seen")},
        "tokens_per_s": totals.input_tokens / step_s,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "score_mean": sum(batch.scores) / len(batch.scores),
        "response_len_mean": sum(len(r) for r in batch.response_ids) / len(batch),
        "truncated_frac": sum(batch.truncated) / len(batch),
        "kl": totals.stat("kl"),
        "clip_frac": totals.stat("clipped"),
        "entropy": totals.stat("entropy"),
        "pg_loss": totals.stat("pg_loss"),
        **mismatch_metrics(totals, correction),
        **({"critic_loss": totals.critic_loss_sum / totals.num_updates, "value_loss": totals.stat("value_loss"),
            "value_clip_frac": totals.stat("value_clipped"), "value_mean": totals.stat("value_mean")}
           if with_critic else {}),
        **(router_metrics(totals.router_means()) if totals.router is not None else {}),
        "filtered_groups": rounds.filtered_groups,
        "filler_groups": rounds.filler_groups,
        "generation_rounds": rounds.rounds,
        "reward_errors": rounds.reward_errors,
        "optimizer_steps": counters["optimizer_steps"],
        "step_s": step_s,
        **timings,
    }
