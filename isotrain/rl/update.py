"""From a scored rollout to optimizer steps: advantages, mini-batches, the shared gradient step.

Every rank holds the whole rollout, so the advantages and the mini-batch composition are computed
identically everywhere and depend only on (seed, step, epoch) and the rollout:

    epoch e: groups in the order permutation(P) drawn from rng(seed, step, e)
    mini-batch j: groups [j·M, (j+1)·M) of that order, n samples each (M·n sequences)
    rank r: the contiguous slice [r·M·n/DP, (r+1)·M·n/DP), cut into micro-batches

Only the last line depends on the layout, and the loss is normalised globally (objective.py),
so the update of a mini-batch is the same for any DP size and micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from isotrain.config import RLConfig
from isotrain.parallel.dist import all_reduce_sum
from isotrain.rl.algos import group_advantages, kl_penalty, reinforce_pp_advantages
from isotrain.rl.experience import RolloutBatch, make_micro_batch
from isotrain.rl.objective import STAT_NAMES, RLObjective
from isotrain.train.step import accumulate_gradients, optimizer_step, step_options  # noqa: F401 (re-exported)


def pad_rows(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-token rows -> (values [B, T], mask [B, T]) in float64."""
    length = max((len(r) for r in rows), default=0)
    values = torch.zeros(len(rows), max(length, 1), dtype=torch.float64)
    mask = torch.zeros_like(values)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[i, : len(row)] = 1.0
    return values, mask


def advantages(batch: RolloutBatch, rl: RLConfig, old_logprobs, ref_logprobs) -> list[list[float]]:
    """Per-token advantages of every sample (response coordinates).

    KL in the reward (rl.kl_in_reward) is a per-token penalty kl_coef·KL_t: REINFORCE++ subtracts it
    from each token's reward before the discounted returns; outcome estimators subtract its sum
    over the response from the sample's reward before the group baseline.
    """
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    lengths = [len(r) for r in batch.response_ids]
    kl = None
    if rl.kl_coef > 0 and rl.kl_in_reward:
        logp, mask = pad_rows(old_logprobs)
        kl = kl_penalty(logp, pad_rows(ref_logprobs)[0], rl.kl_estimator) * mask
    if rl.advantage == "reinforce_pp":
        values, mask = pad_rows([[0.0] * n for n in lengths])
        last = torch.tensor([max(n - 1, 0) for n in lengths])
        values[torch.arange(len(lengths)), last] = rewards * (torch.tensor(lengths) > 0)
        if kl is not None:
            values = values - rl.kl_coef * kl
        token_adv = reinforce_pp_advantages(values, mask, rl.gamma)
        return [token_adv[i, :n].tolist() for i, n in enumerate(lengths)]
    if kl is not None:
        rewards = rewards - rl.kl_coef * kl.sum(dim=1)
    per_sample = group_advantages(rl.advantage, rewards.view(-1, rl.group_size), rl.norm_adv_by_std).reshape(-1)
    return [[float(a)] * n for a, n in zip(per_sample.tolist(), lengths)]


@dataclass
class UpdateTotals:
    """Sums over the optimizer steps of one RL step (global values)."""

    num_updates: int = 0
    loss_sum: float = 0.0
    grad_norm_sum: float = 0.0
    input_tokens: int = 0
    samples: int = 0
    lr: float = 0.0
    stats: torch.Tensor = field(default_factory=lambda: torch.zeros(len(STAT_NAMES), dtype=torch.float64))

    def stat(self, name: str) -> float:
        tokens = float(self.stats[0])
        return float(self.stats[STAT_NAMES.index(name)]) / tokens if tokens else 0.0


def mini_batch_samples(step: int, epoch: int, seed: int, num_groups: int, mini_groups: int, n: int) -> list[list[int]]:
    order = np.random.default_rng([seed % 2**64, step, epoch]).permutation(num_groups)
    return [[int(g) * n + k for g in order[j : j + mini_groups] for k in range(n)]
            for j in range(0, num_groups, mini_groups)]


def run_updates(model, optimizer, batch: RolloutBatch, per_token: dict, ctx, step: int, lr_of) -> UpdateTotals:
    """Every optimizer step of one rollout; `lr_of(k)` is the learning rate of the k-th step of this rollout.

    ctx carries: cfg, plan, rank (DP rank), device, options (StepOptions), pad_id, before_update."""
    cfg, plan, rl = ctx.cfg, ctx.plan, ctx.cfg.rl
    objective = RLObjective(rl)
    totals = UpdateTotals()
    per_rank = plan.samples_per_optimizer_step // plan.dp_size
    parameters = [p for p in model.parameters() if p.requires_grad]
    for epoch in range(rl.ppo_epochs):
        for samples in mini_batch_samples(step, epoch, cfg.train.seed, plan.prompts_per_step,
                                          plan.mini_batch_prompts, plan.group_size):
            mine = samples[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
            micro = [mine[i : i + plan.micro_batch_size] for i in range(0, len(mine), plan.micro_batch_size)]
            mbs = [make_micro_batch(batch.select(ix), ctx.pad_id, rl.mask_truncated,
                                    {k: ([v[i] for i in ix] if v is not None else None) for k, v in per_token.items()})
                   for ix in micro]
            # The global denominator and counts, all-reduced before any backward.
            local = [sum(objective.denominator(mb) for mb in mbs), sum(mb["num_input_tokens"] for mb in mbs), len(mine)]
            denominator, input_tokens, num_samples = all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
            stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=ctx.device)
            loss = accumulate_gradients(
                model, mbs, lambda mb, autocast: objective.loss_sum(model, mb, autocast, ctx.device, stats),
                denominator, ctx.options, ctx.device)
            totals.stats += all_reduce_sum(stats).cpu()
            ctx.before_update()
            totals.lr = lr_of(totals.num_updates)
            totals.grad_norm_sum += optimizer_step(optimizer, parameters, totals.lr, cfg.train.grad_clip)
            totals.loss_sum += loss
            totals.num_updates += 1
            totals.input_tokens += int(input_tokens)
            totals.samples += int(num_samples)
    return totals
