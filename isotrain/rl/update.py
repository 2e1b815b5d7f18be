"""From a scored rollout to optimizer steps: advantages, mini-batches, the shared gradient step.

Every rank holds the whole rollout, so the advantages and the mini-batch composition are computed
identically everywhere and depend only on (seed, step, epoch) and the rollout:

    epoch e: groups in the order permutation(P) drawn from rng(seed, step, e)
    mini-batch j: groups [j·M, (j+1)·M) of that order, n samples each (M·n sequences)
    rank r: the contiguous slice [r·M·n/DP, (r+1)·M·n/DP), cut into micro-batches

Only the last line depends on the layout, and the loss is normalised globally (objective.py),
so the update of a mini-batch is the same for any DP size and micro-batch size. The CP ranks of a DP rank
(parallel.cp) have the same DP rank, so they take the same slice and micro-batches, and each runs its piece of
every row (rl/pieces.py). An MoE policy adds the
router terms of the SFT step (train/step.py, isotrain/moe/), pooled over every real prompt + response token
of the mini-batch (`global` scope) or of each micro-batch (`micro_batch`); the critic and the frozen
reference get none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from isotrain.config import RLConfig, RLRunConfig
from isotrain.moe.objective import RouterStep, RouterValues
from isotrain.parallel.dist import all_reduce_sum
from isotrain.rl.algos import (
    gae_advantages,
    group_advantages,
    kl_penalty,
    masked_whiten,
    reinforce_pp_advantages,
)
from isotrain.rl.critic import CRITIC_STATS, critic_step
from isotrain.rl.experience import RolloutBatch, RowLayout, forward_output, make_micro_batch
from isotrain.rl.objective import STAT_NAMES, RLObjective
from isotrain.rl.pieces import NO_CP, Pieces
from isotrain.sizes import RLBatchPlan
from isotrain.train.step import StepOptions, accumulate_objective, optimizer_step


def pad_rows(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-token rows -> (values [B, T], mask [B, T]) in float64."""
    length = max((len(r) for r in rows), default=0)
    values = torch.zeros(len(rows), max(length, 1), dtype=torch.float64)
    mask = torch.zeros_like(values)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[i, : len(row)] = 1.0
    return values, mask


def _token_rewards(rewards: torch.Tensor, lengths: list[int], kl, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample's reward on its last response token, minus kl_coef·KL_t on every token when KL is in the reward."""
    values, mask = pad_rows([[0.0] * n for n in lengths])
    last = torch.tensor([max(n - 1, 0) for n in lengths])
    values[torch.arange(len(lengths)), last] = rewards * (torch.tensor(lengths) > 0)
    if kl is not None:
        values = values - kl_coef * kl
    return values, mask


def advantages(batch: RolloutBatch, rl: RLConfig, old_logprobs, ref_logprobs,
               old_values=None) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-token advantages of every sample (response coordinates), and PPO's returns (None otherwise).

    KL in the reward (rl.kl_in_reward) is a per-token penalty kl_coef·KL_t: REINFORCE++ and PPO subtract
    it from each token's reward; outcome estimators subtract its sum over the response from the
    sample's reward before the group baseline.
    """
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    lengths = [len(r) for r in batch.response_ids]
    kl = None
    if rl.kl_coef > 0 and rl.kl_in_reward:
        logp, mask = pad_rows(old_logprobs)
        kl = kl_penalty(logp, pad_rows(ref_logprobs)[0], rl.kl_estimator, rl.kl_clip) * mask
    if rl.advantage == "gae":
        token_rewards, mask = _token_rewards(rewards, lengths, kl, rl.kl_coef)
        token_adv, returns = gae_advantages(token_rewards, pad_rows(old_values)[0], mask, rl.gamma, rl.lam)
        token_adv = masked_whiten(token_adv, mask)
        return ([token_adv[i, :n].tolist() for i, n in enumerate(lengths)],
                [returns[i, :n].tolist() for i, n in enumerate(lengths)])
    if rl.advantage == "reinforce_pp":
        token_rewards, mask = _token_rewards(rewards, lengths, kl, rl.kl_coef)
        token_adv = reinforce_pp_advantages(token_rewards, mask, rl.gamma)
        return [token_adv[i, :n].tolist() for i, n in enumerate(lengths)], None
    if kl is not None:
        rewards = rewards - rl.kl_coef * kl.sum(dim=1)
    per_sample = group_advantages(rl.advantage, rewards.view(-1, rl.group_size), rl.norm_adv_by_std).reshape(-1)
    return [[float(a)] * n for a, n in zip(per_sample.tolist(), lengths)], None


def recomputes_old_logprobs(rl: RLConfig, optimizer_steps_per_rollout: int) -> bool:
    """Whether the trainer runs a forward for π_old's log-probs before the updates. With one optimizer step per
    rollout the old policy is the current one (on-policy shortcut), and `bypass` takes the engine's log-probs as
    π_old; KL in the reward still needs the trainer's own."""
    for_ratio = optimizer_steps_per_rollout > 1 and rl.correction != "bypass"
    return for_ratio or (rl.kl_coef > 0 and rl.kl_in_reward)


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
    critic_loss_sum: float = 0.0
    critic_stats: torch.Tensor = field(default_factory=lambda: torch.zeros(len(CRITIC_STATS), dtype=torch.float64))
    router: RouterValues | None = None  # MoE policy: aux and z summed over the steps, counts summed (global)

    def add_router(self, values: RouterValues | None) -> None:
        if values is None:
            return
        if self.router is None:
            self.router = RouterValues(values.aux_loss, values.z_loss, [list(row) for row in values.counts])
            return
        self.router.aux_loss += values.aux_loss
        self.router.z_loss += values.z_loss
        self.router.counts = [[a + b for a, b in zip(mine, theirs)]
                              for mine, theirs in zip(self.router.counts, values.counts)]

    def router_means(self) -> RouterValues | None:
        """The metrics row's router values: aux and z averaged over the optimizer steps of the rollout, the
        routing counts of all of them summed (the load of the whole rollout's updates)."""
        if self.router is None:
            return None
        n = max(self.num_updates, 1)
        return RouterValues(self.router.aux_loss / n, self.router.z_loss / n, self.router.counts)

    def stat(self, name: str) -> float:
        """A token mean over every optimizer step of the rollout."""
        tokens = float(self.stats[0])
        source, names = (self.critic_stats, CRITIC_STATS) if name in CRITIC_STATS else (self.stats, STAT_NAMES)
        return float(source[names.index(name)]) / tokens if tokens else 0.0


def mini_batch_samples(step: int, epoch: int, seed: int, num_groups: int, mini_groups: int, n: int) -> list[list[int]]:
    order = np.random.default_rng([seed % 2**64, step, epoch]).permutation(num_groups)
    return [[int(g) * n + k for g in order[j : j + mini_groups] for k in range(n)]
            for j in range(0, num_groups, mini_groups)]


def _policy_loss_sum(objective: RLObjective, model, device: torch.device, stats: torch.Tensor,
                     router: RouterStep | None):
    """The policy's loss_sum for train/step.py: (mb, autocast) -> Σ_t a_t ℓ_t, or with an MoE policy's router
    terms (mb, autocast, index) -> (that sum, the micro-batch's router term)."""

    def loss_sum(mb: dict, autocast, index: int | None = None):
        return objective.loss_sum(model, mb, autocast, device, stats, router, index)

    return loss_sum


@dataclass(frozen=True)
class UpdateContext:
    """What every optimizer step of a rollout works with, fixed for the run."""

    cfg: RLRunConfig
    plan: RLBatchPlan
    dp_rank: int
    device: torch.device
    options: StepOptions
    pad_id: int
    layout: RowLayout  # padded or packed micro-batches (rl/packing.py)
    before_update: Callable[[], None]  # after the backward, before clipping (the checkpoint's staging hook)
    critic: torch.nn.Module | None = None  # PPO: the critic takes one step on every mini-batch too
    critic_optimizer: torch.optim.Optimizer | None = None
    pieces: Pieces = NO_CP  # parallel.cp: each CP rank runs its piece of every row (rl/pieces.py)


def run_updates(model, optimizer, batch: RolloutBatch, per_token: dict, ctx: UpdateContext, step: int,
                lr_of) -> UpdateTotals:
    """Every optimizer step of one rollout; `lr_of(k)` is the learning rate of the k-th step of this rollout."""
    cfg, plan, rl = ctx.cfg, ctx.plan, ctx.cfg.rl
    objective = RLObjective(rl, ctx.pieces)
    totals = UpdateTotals()
    per_rank = plan.samples_per_optimizer_step // plan.dp_size
    parameters = [p for p in model.parameters() if p.requires_grad]
    for epoch in range(rl.ppo_epochs):
        for samples in mini_batch_samples(step, epoch, cfg.train.seed, plan.prompts_per_step,
                                          plan.mini_batch_prompts, plan.group_size):
            mine = samples[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank]
            micro = [mine[i : i + plan.micro_batch_size] for i in range(0, len(mine), plan.micro_batch_size)]
            mbs = [make_micro_batch(batch.select(ix), ctx.pad_id, rl.mask_truncated,
                                    {k: ([v[i] for i in ix] if v is not None else None) for k, v in per_token.items()},
                                    ctx.layout)
                   for ix in micro]
            # The global denominator and counts, all-reduced before any backward.
            local = [sum(objective.denominator(mb) for mb in mbs), sum(mb["num_input_tokens"] for mb in mbs), len(mine)]
            denominator, input_tokens, num_samples = all_reduce_sum(torch.tensor(local, dtype=torch.float64),
                                                                    ctx.options.dp_group).tolist()
            stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=ctx.device)
            loss, router = accumulate_objective(
                model, mbs, functools.partial(_policy_loss_sum, objective, model, ctx.device, stats),
                lambda mb: forward_output(model, mb, ctx.device, router_logits=True),
                denominator, ctx.options, ctx.device)
            totals.stats += all_reduce_sum(ctx.pieces.sum(stats), ctx.options.dp_group).cpu()
            totals.add_router(router)
            ctx.before_update()
            totals.lr = lr_of(totals.num_updates)
            totals.grad_norm_sum += optimizer_step(optimizer, parameters, totals.lr, cfg.train.grad_clip, loss)
            if ctx.critic is not None:
                critic_loss, _, critic_stats = critic_step(ctx.critic, ctx.critic_optimizer, mbs, denominator, rl,
                                                           cfg.train.grad_clip, ctx.options, ctx.device,
                                                           rl.critic_lr or totals.lr, ctx.pieces)
                totals.critic_loss_sum += critic_loss
                totals.critic_stats += all_reduce_sum(ctx.pieces.sum(critic_stats), ctx.options.dp_group).cpu()
            totals.loss_sum += loss
            totals.num_updates += 1
            totals.input_tokens += int(input_tokens)
            totals.samples += int(num_samples)
    return totals
