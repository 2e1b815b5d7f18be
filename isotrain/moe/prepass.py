"""The routing pre-pass of the `global` scope: the global routing counts before the first backward.

With several micro-batches per rank, the first micro-batch's backward needs f_e of the whole global batch,
which depends on how the later micro-batches route. So each rank first runs a forward without gradient over
all of its micro-batches (cost: one extra forward per step, about a third of a step's compute) and the counts are
all-reduced over DP (and CP: under context parallelism each rank routes its piece of every sequence, inside the
same context-parallel attention as the gradient pass). The gradient pass then checks that it routes every
micro-batch as the pre-pass did (objective.py). With one micro-batch per rank no pre-pass runs: the counts are
all-reduced after its forward. Under pipeline parallelism the pre-pass is a forward-only run of the micro-batches
through the pipeline, each stage counting its own MoE layers, always (the stages' terms need every layer's counts;
with `micro_batch` scope, every layer's counts of their micro-batch).
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


def micro_batch_index(mask: torch.Tensor, masks: list[torch.Tensor]) -> int | None:
    """Which of the step's micro-batches a pipeline stage runs, by its input-token mask (None: a copy of one, which
    torch's shape inference runs)."""
    return next((i for i, m in enumerate(masks) if m is mask), None)


def runs_pipeline_prepass(settings: RouterSettings) -> bool:
    """Whether a pipeline's step runs the routing pre-pass (`begin_pipeline_router_step`): with coefficients to
    train, or under micro_batch scope, which logs each micro-batch's aux pooled over every stage's layers."""
    return settings.aux_loss_coef > 0 or settings.z_loss_coef > 0 or settings.aux_loss_scope == "micro_batch"


def begin_pipeline_router_step(settings: RouterSettings, masks: list[torch.Tensor], run_forward,
                               stage_rows: dict[int, list[int]], num_layers: int, group, pp_group,
                               device: torch.device) -> RouterStep:
    """The step's RouterStep on a pipeline rank, whose stages' router logits cover their own MoE layers
    (`stage_rows`: each held stage's rows among the model's `num_layers`; a rank of the interleaved or V-shaped
    schedules holds several stages); with coefficients to train, after the routing pre-pass.

    `run_forward(router_fn)` runs every micro-batch forward through the pipeline without gradient, calling
    `router_fn(output, router_logits, mask, rows)` with the router logits of one held stage (whose rows are `rows`)
    for the micro-batch whose input-token mask is `mask` (one of `masks`); the counts are laid out over all layers
    and summed over the micro-batches, DP and the stages (RouterStep.set_pipeline_pool). The stage holding the
    model's first MoE layer counts the tokens. A rank of dense layers only (no rows) routes nothing: its counts are
    zero rows."""
    layer_rows = sorted(row for rows in stage_rows.values() for row in rows)
    step = RouterStep(settings, len(masks), group, layer_rows=layer_rows, num_model_layers=num_layers, device=device)
    if not runs_pipeline_prepass(settings):
        return step
    # Each micro-batch's counts through this rank's layers [L_rank, E], filled by each held stage's forward.
    expected = [torch.zeros((len(layer_rows), settings.num_experts), dtype=torch.int64, device=device)
                for _ in masks]

    def record(output, router_logits, mask, rows):
        index = micro_batch_index(mask, masks)
        if index is not None:
            at = [layer_rows.index(row) for row in rows]
            expected[index][at] = routing_counts(layer_logits(router_logits), settings.top_k, mask).to(torch.int64)
        return output

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        run_forward(record)
    step.set_pipeline_pool(expected, masks, pp_group)
    return step
