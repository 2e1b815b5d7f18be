"""The SFT step's backward passes under pipeline parallelism (parallel.pp > 1, parallel/pp.py).

train/step.py runs them for `train_step` and `forward_backward` when `pipelined(options)`; they live here so that the
step keeps one file of its own size (STYLE.md rule 5). The step order and its invariants are in step.py's docstring
(stage 3); the maths of the schedule is in parallel/pp.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from isotrain.models.packing_check import attention_kwargs
from isotrain.models.unwrap import hf_model
from isotrain.moe.objective import RouterStep
from isotrain.moe.prepass import begin_pipeline_router_step, micro_batch_index
from isotrain.moe.routing import input_token_mask
from isotrain.parallel.apply import sync_replica_grads
from isotrain.parallel.cp import pad_micro_batch
from isotrain.parallel.dist import all_reduce_max, all_reduce_sum
from isotrain.parallel.pp import SPLIT_BACKWARD, Pipeline, sync_tied_grads, with_side_loss
from isotrain.train.chunked_loss import stage_chunked_forward
from isotrain.train.loss import loss_weights, token_losses
from isotrain.train.step_options import StepOptions, autocast_context, loss_parallel_context


def pipelined(options: StepOptions) -> bool:
    """Whether the step runs through pipeline stages (parallel.pp > 1)."""
    return options.parallel is not None and options.parallel.dims.pp > 1


def _pipeline_router_step(model: nn.Module, pipeline: Pipeline, inputs: list[torch.Tensor] | None, kwargs: list[dict],
                          masks: list[torch.Tensor], options: StepOptions, device: torch.device) -> RouterStep | None:
    """An MoE model's router terms under pipeline parallelism (None for a dense model), after the routing pre-pass
    through the pipeline (isotrain/moe/prepass.py), run as the gradient pass runs (same autocast)."""
    if options.router is None:
        return None
    parallel = options.parallel
    stage_rows, num_layers = pipeline.moe_layer_rows(hf_model(model))

    def run_forward(record):
        def router_fn(output, router_logits, mask):  # (each held stage through its own layers' rows)
            return record(output, router_logits, mask, stage_rows[pipeline.routing_stage])

        with autocast_context(options, device), loss_parallel_context(options):
            pipeline.forward(hf_model(model), inputs, kwargs, router_fn, device)

    return begin_pipeline_router_step(options.router, masks, run_forward, stage_rows, num_layers, options.dp_group,
                                      parallel.pp_group, device)


def pipeline_backpropagate(model: nn.Module, micro_batches: list[dict], denominator, options: StepOptions,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, RouterStep | None]:
    """The SFT backward passes under pipeline parallelism (parallel/pp.py): (the global loss sum, an fp64 tensor;
    an MoE model's global router values, else None; its RouterStep, else None).

    The last stage's loss of micro-batch m is Σ_{t∈m} w_t·ℓ_t / D (D global, known before the first backward) and
    the schedule does not rescale it, so the stages' gradients are those of the global mean, as train/step.py's
    without a pipeline.
    The micro-batches are padded to one length, the longest of any DP rank's (a stage's receive buffers have one
    shape); padding weighs 0. A rank of middle stages holds each micro-batch's position and segment ids alone
    (train/stage_data.py): it passes no token ids and no targets, which only the first and the last stage read.
    An MoE model's stages each add their layers' router terms to their micro-batch outputs' backward (`with_side_loss`:
    the terms carry the global normalisation, so nothing is counted twice); their logged sums are laid out over all the
    model's MoE layers and summed over the stages and DP."""
    parallel = options.parallel
    pipeline = options.pipeline or Pipeline.of(parallel)
    # One length on every DP rank, so that a stage's DP ranks build their schedules (torch's shape inference runs the
    # stage, FSDP2's collectives included) at the same steps and reuse them at the same steps (parallel/pp.py).
    length = all_reduce_max(max(mb["position_ids"].shape[1] for mb in micro_batches), options.dp_group, device)
    padded = [pad_micro_batch(mb, length) for mb in micro_batches]
    weighted_sums = []
    read = "labels" in padded[0]  # (train/stage_data.py)
    targets = [torch.stack([mb["labels"], mb["segment_ids"]]).to(device) for mb in padded] if read else None
    chunk_tokens = options.loss_chunk_tokens

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """target [2, B, L]: the micro-batch's labels and segment ids. A stage also calls it once with a copy of the
        first target and uninitialised logits when it is built, to learn the shapes of the gradients it sends: that
        call is not one of the micro-batches' and is not counted. With the chunked loss, `logits` is the last stage's
        output already: the micro-batch's Σ_t w_t·ℓ_t (`head_loss`)."""
        if chunk_tokens:
            weighted_sum = logits
        else:
            labels, segments = target
            weights, _ = loss_weights(labels, segments, options.loss_reduction)
            weighted_sum = (token_losses(logits, labels) * weights).sum()
        if any(target is t for t in targets or ()):
            weighted_sums.append(weighted_sum.detach().double())
        return weighted_sum / denominator

    kwargs = []
    for mb in padded:
        positions = mb["position_ids"].to(device)
        kwargs.append({"position_ids": positions, **attention_kwargs(model, positions, options.document_mask)})
    inputs = [mb["input_ids"] for mb in padded] if read else None
    if chunk_tokens and read:  # the last stage computes each micro-batch's loss in chunks, inside its forward
        kwargs = [{**kw, "micro_batch": index} for index, kw in enumerate(kwargs)]
    router_fn = router = None
    if options.router is not None:  # each micro-batch's input tokens travel with it to every stage
        masks = [input_token_mask(mb["segment_ids"]).to(device) for mb in padded]
        kwargs = [{**kw, "router_mask": mask} for kw, mask in zip(kwargs, masks, strict=True)]
        router = _pipeline_router_step(model, pipeline, inputs, kwargs, masks, options, device)
        stage_rows, _ = pipeline.moe_layer_rows(hf_model(model))
        split_backward = parallel.dims.pp_schedule in SPLIT_BACKWARD

        def router_fn(output, router_logits, mask):
            index = micro_batch_index(mask, masks)
            if index is None:  # torch's shape inference
                return output
            rows = stage_rows[pipeline.routing_stage]  # the stage's own term (a rank may hold several stages)
            return with_side_loss(output, router.term(router_logits, mask, index, rows), split_backward)

    head_loss = None
    if chunk_tokens and read:

        def head_loss(stage_model: nn.Module, stage_inputs: dict, stage_kwargs: dict, index: int):
            mb = padded[index]
            weights, _ = loss_weights(mb["labels"].to(device), mb["segment_ids"].to(device), options.loss_reduction)
            return stage_chunked_forward(stage_model, stage_inputs, stage_kwargs, mb["labels"], weights, chunk_tokens,
                                         options.compile_loss)

    # (TP: the last stage's logits stay vocab-sharded)
    with autocast_context(options, device), loss_parallel_context(options):
        pipeline.backward(hf_model(model), inputs, kwargs, targets, loss_fn, device, router_fn, head_loss)
    sync_replica_grads(model, parallel)  # PP × DDP: each stage's gradients summed over its DP replicas
    # A tied embedding's copies (first and last stage): each stage's part of its gradient, summed over the two.
    sync_tied_grads(hf_model(model), parallel.pp_rank, parallel.dims.pp, parallel.embed_group)
    local_loss_sum = torch.stack(weighted_sums).sum() if weighted_sums else torch.zeros((), dtype=torch.float64,
                                                                                           device=device)
    local = local_loss_sum.reshape(1) if router is None else torch.cat([local_loss_sum.reshape(1),
                                                                        router.local_values()])
    values = all_reduce_sum(all_reduce_sum(local, parallel.pp_group), options.dp_group)
    return values[0], (None if router is None else values[1:]), router
