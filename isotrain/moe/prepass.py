"""The routing pre-pass of the `global` scope: the global routing counts before the first backward.

With several micro-batches per rank, the first micro-batch's backward needs f_e of the whole global batch,
which depends on how the later micro-batches route. So each rank first runs a forward without gradient over
all of its micro-batches (cost: one extra forward per step, about a third of a step's compute) and the counts are
all-reduced over DP (and CP: under context parallelism each rank routes its piece of every sequence, inside the
same context-parallel attention as the gradient pass). The gradient pass then checks that it routes every
micro-batch as the pre-pass did (objective.py). With one micro-batch per rank no pre-pass runs: the counts are
all-reduced after its forward.
"""

from __future__ import annotations

import torch

from isotrain.moe.objective import RouterStep, sum_over_pool
from isotrain.moe.routing import input_token_mask, layer_logits, routing_counts
from isotrain.moe.settings import RouterSettings


def needs_prepass(settings: RouterSettings, num_micro_batches: int) -> bool:
    """Only the gradient needs the global counts first: with both coefficients 0 the logged values suffice."""
    trained = settings.aux_loss_coef > 0 or settings.z_loss_coef > 0
    return trained and settings.aux_loss_scope == "global" and num_micro_batches > 1


def begin_router_step(settings: RouterSettings, routed: list[dict], router_forward, group,
                      device: torch.device, cp_group=None) -> RouterStep:
    """The step's RouterStep; with `global` scope and several micro-batches, after the pre-pass.

    `routed`: the rank's micro-batches as it routes them (under context parallelism its pieces of them, whose
    counts are summed over `cp_group` as well as over the DP `group`). `router_forward(i)` runs the model's forward
    of micro-batch i as the gradient pass will (same autocast, same context-parallel attention) and returns its
    router logits. The pre-pass draws nothing from the RNGs the gradient pass sees (forked), so a model with
    dropout keeps the random stream of a run without pre-pass."""
    step = RouterStep(settings, len(routed), group, cp_group)
    if not needs_prepass(settings, len(routed)):
        return step
    expected, tokens = [], torch.zeros((), dtype=torch.int64, device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        for index, mb in enumerate(routed):
            mask = input_token_mask(mb["segment_ids"].to(device))
            expected.append(routing_counts(layer_logits(router_forward(index)), settings.top_k, mask))
            tokens = tokens + mask.sum()
    local = torch.cat([tokens.reshape(1), torch.stack(expected).sum(0).reshape(-1)])
    tally = sum_over_pool(local, group, cp_group)
    step.global_tokens, step.global_counts = tally[0], tally[1:].view_as(expected[0])
    step.expected_counts = expected
    return step
