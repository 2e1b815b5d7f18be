"""One optimizer step over a rank's micro-batches, with exact global normalisation.

Order of a step (the invariant each stage keeps is in brackets):
  1. count input tokens, trained tokens, loss denominator and samples of every local micro-batch,
     and all-reduce them over DP — before any backward [the loss divides by the global count];
  2. per micro-batch: forward, Σ weighted token losses / global denominator, backward; DDP syncs
     (SUM) only on the last micro-batch [gradient = gradient of the global mean]; an MoE model adds its router
     terms, each micro-batch its exact share of the global aux / z-loss (isotrain/moe/; with `global` scope and
     several micro-batches a no-grad routing pre-pass first gives the global expert counts);
  3. all-reduce the summed loss values (and router values) over DP [the logged loss is the global objective];
     under context parallelism each CP rank ran one piece of every sequence (parallel/cp.py), so its loss sum
     is summed over CP as well, while the counts of step 1, taken from the whole micro-batches that every CP rank
     of a DP rank holds alike, are summed over DP only (summed over CP they would count each token cp times); an
     MoE model's routing loads, counted on the pieces each rank routes, are summed over DP × CP (isotrain/moe/);
     under pipeline parallelism (parallel/pp.py; the step's path: train/pipeline_step.py) the micro-batches run
     through the stages by the run's schedule, the last stage computes each micro-batch's Σ_t w_t·ℓ_t / D, the
     schedule never rescales, and the loss sum is summed over the stages (the others hold 0) and DP; the counts of
     step 1 are summed over DP only (every stage of a pipeline holds the same micro-batches' counts; a middle
     stage, which reads no data, gets them from the first: train/stage_data.py), and each stage's gradients over
     that stage's DP ranks; an MoE model's stages attach their layers' router terms to their outputs' backward,
     against the pool of all layers from a forward-only pre-pass through the pipeline, and their router sums are
     summed over the stages;
  4. TP × DDP replicas sum their gradients over dp_replicate; partial TP gradients are summed over TP;
     global grad norm (every element counted once, one fp64 all-reduce), clip, set the lr, optimizer step;
     a NaN or infinite loss or norm stops the run before the update [weights and checkpoints stay finite].
The SFT step (`train_step`) leaves the counts, the loss, the router values and the norm on the device and fetches
them together, once, before the update: one host sync per step.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from isotrain.errors import TrainingError
from isotrain.models.packing_check import lm_forward
from isotrain.models.unwrap import hf_model
from isotrain.moe.routing import input_token_mask
from isotrain.moe.objective import RouterStep, RouterValues, check_routing, router_values
from isotrain.moe.prepass import begin_router_step
from isotrain.parallel.dist import all_reduce_sum
from isotrain.parallel.apply import sync_replica_grads
from isotrain.parallel.cp import context_parallel_attention, local_piece, pad_rows, padded_length
from isotrain.parallel.pp import tied_parameters
from isotrain.train.chunked_loss import no_positions, sft_chunked_forward
from isotrain.train.loss import loss_weights, micro_batch_counts, token_losses
from isotrain.train.pipeline_step import pipeline_backpropagate, pipelined
from isotrain.train.step_options import StepOptions, autocast_context, loss_parallel_context


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_input_tokens: int  # global, this step
    num_trained_tokens: int  # global, this step
    num_samples: int  # global, this step
    router: RouterValues | None = None  # MoE models: aux / z-loss and expert loads (loss includes their terms)


def _global_counts(micro_batches: list[dict], reduction: str, device: torch.device, group=None) -> torch.Tensor:
    """int64 [4]: [input tokens, trained tokens, loss denominator, samples] summed over micro-batches and DP ranks,
    left on the device (the step fetches it with its other values)."""
    local = torch.tensor([micro_batch_counts(mb, reduction) for mb in micro_batches], dtype=torch.int64).sum(0)
    return all_reduce_sum(local.to(device), group)


def global_counts(micro_batches: list[dict], reduction: str, device: torch.device, group=None) -> list[int]:
    """[input tokens, trained tokens, loss denominator, samples] summed over micro-batches and DP ranks."""
    return [int(c) for c in _global_counts(micro_batches, reduction, device, group).tolist()]


def _sync_context(model: nn.Module, is_last: bool):
    """DDP all-reduces gradients only at the last micro-batch; FSDP2 reduce-scatters each one."""
    if isinstance(model, DistributedDataParallel) and not is_last:
        return model.no_sync()
    return contextlib.nullcontext()


def accumulate_gradients(model: nn.Module, micro_batches: list, loss_sum, denominator: float,
                         options: StepOptions, device: torch.device) -> float:
    """Backpropagate Σ_mb loss_sum(mb) / denominator; return the global value of that loss.

    `loss_sum(mb, autocast)` gives one micro-batch's weighted token-loss sum (a scalar with grad),
    running the model forward (only) inside `autocast`, so losses stay in fp32. The
    denominator is already global (all-reduced over DP before any backward), so every micro-batch
    backpropagates its exact share of the global loss and the summed gradient does not depend on
    the split (invariant 1). SFT and RL differ only in `loss_sum` and in how they count.
    """
    global_sum, _ = _backpropagate(model, micro_batches, loss_sum, max(denominator, 1), options, device)
    return float(global_sum) / max(denominator, 1)


def accumulate_objective(model: nn.Module, micro_batches: list, make_loss_sum, forward, denominator: float,
                         options: StepOptions, device: torch.device) -> tuple[float, RouterValues | None]:
    """accumulate_gradients of a model that may be an MoE model: (global objective, router values or None).

    With `options.router` the step gets the router terms of the SFT step (a RouterStep, after the routing pre-pass
    when the scope needs one): `make_loss_sum(router)` gives the `loss_sum(mb, autocast, index)` -> (weighted sum,
    router term) of `_backpropagate`, and `forward(mb)` runs the model as that loss_sum does, returning its output
    with router logits (for the pre-pass). A dense model: `make_loss_sum(None)` is accumulate_gradients' loss_sum.
    The returned objective includes the router terms; a gradient pass that routed differently from its pre-pass
    is refused (TrainingError) before any update."""
    router = _router_step(micro_batches, forward, options, device)
    global_sum, values = _backpropagate(model, micro_batches, make_loss_sum(router), max(denominator, 1), options,
                                        device, router)
    loss = float(global_sum) / max(denominator, 1)
    result = _router_result(values.tolist(), router) if router is not None else None
    return (loss if result is None else loss + result.objective(router.settings)), result


def _backpropagate(model: nn.Module, micro_batches: list, loss_sum, denominator, options: StepOptions,
                   device: torch.device, router: RouterStep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """accumulate_gradients without a host sync: `denominator` (>= 1) may be a device tensor, and the
    global Σ loss_sum comes back as an fp64 tensor, all-reduced over DP.

    With `router`, `loss_sum(mb, autocast, index)` returns (weighted token-loss sum, router term); the router term
    is already globally normalised and joins the objective as it is. Its logged values (RouterStep.local_values)
    come back summed over DP (and CP), from the same all-reduces as the loss (else None)."""
    local_loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        # Vocabulary-parallel cross-entropy: forward and backward both run inside loss_parallel; so does context
        # parallel attention (activation checkpointing recomputes the forward inside the backward).
        with _sync_context(model, i == len(micro_batches) - 1), loss_parallel_context(options), \
                _context_parallel(options, mb, device):
            if router is None:
                weighted_sum = loss_sum(mb, autocast_context(options, device))
                (weighted_sum / denominator).backward()
            else:
                weighted_sum, router_term = loss_sum(mb, autocast_context(options, device), i)
                (weighted_sum / denominator + router_term).backward()
        local_loss_sum += weighted_sum.detach().double()
    if options.parallel is not None:
        sync_replica_grads(model, options.parallel)
    local = local_loss_sum.reshape(1) if router is None else torch.cat([local_loss_sum.reshape(1),
                                                                        router.local_values()])
    cp_group = options.parallel.cp_group if options.parallel is not None else None
    if cp_group is not None:  # (a group of None would be the world) the pieces' sums: Σ_t over whole sequences
        local = all_reduce_sum(local, cp_group)
    values = all_reduce_sum(local, options.dp_group)
    return values[0], (None if router is None else values[1:])


def _context_parallel(options: StepOptions, mb: dict, device: torch.device):
    """Context parallel attention over the whole rows of `mb` (their position ids padded to a multiple of cp), or
    nothing without CP."""
    parallel = options.parallel
    if parallel is None or parallel.dims.cp == 1:
        return contextlib.nullcontext()
    positions = mb["position_ids"]
    positions = pad_rows(positions, padded_length(positions.shape[1], parallel.dims.cp, parallel.dims.cp_style), None)
    return context_parallel_attention(parallel.cp_group, positions.to(device), parallel.dims.cp_style)


def _cp_piece(mb: dict, weights: torch.Tensor, options: StepOptions) -> tuple[dict, torch.Tensor]:
    """This CP rank's piece of the micro-batch and of its loss weights (computed on the whole rows); the whole
    micro-batch without CP."""
    parallel = options.parallel
    if parallel is None or parallel.dims.cp == 1:
        return mb, weights
    return local_piece(mb, parallel.cp_rank, parallel.dims.cp, weights, parallel.dims.cp_style)


def _sft_forward(model: nn.Module, mb: dict, options: StepOptions, device: torch.device):
    """The model output of one micro-batch (with router logits for an MoE model). With the chunked loss no
    logits are computed here (the routing pre-pass needs none)."""
    keep = no_positions(device) if options.loss_chunk_tokens else None
    return lm_forward(model, mb["input_ids"].to(device), mb["position_ids"].to(device), options.document_mask,
                      router_logits=options.router is not None, logits_to_keep=keep)


def _sft_loss_sum(model: nn.Module, options: StepOptions, device: torch.device, router: RouterStep | None = None):
    """loss_sum(mb, autocast) of SFT: Σ_t weight_t · ℓ_t of one micro-batch (weights: train/loss.py).
    With `router` (MoE): loss_sum(mb, autocast, index) -> (that sum, the micro-batch's router term)."""

    def loss_sum(mb: dict, autocast, index: int | None = None):
        weights, _ = loss_weights(mb["labels"].to(device), mb["segment_ids"].to(device), options.loss_reduction)
        mb, weights = _cp_piece(mb, weights, options)
        labels = mb["labels"].to(device)
        segments = mb["segment_ids"].to(device)
        if options.loss_chunk_tokens:  # the forward computes Σ_t weight_t · ℓ_t itself, chunk by chunk
            with autocast:
                output = sft_chunked_forward(model, mb, weights, options.loss_chunk_tokens, options.document_mask,
                                             device, router_logits=options.router is not None,
                                             compiled=options.compile_loss)
            weighted_sum = output.loss
        else:
            with autocast:
                output = _sft_forward(model, mb, options, device)
            weighted_sum = (token_losses(output.logits, labels) * weights).sum()
        if router is None:
            return weighted_sum
        return weighted_sum, router.term(output.router_logits, input_token_mask(segments), index)

    return loss_sum


def _router_step(micro_batches: list[dict], forward, options: StepOptions,
                 device: torch.device) -> RouterStep | None:
    """The step's router terms (None for a dense model), after the routing pre-pass when the scope needs one.
    `forward(mb)`: the model output of a micro-batch with its router logits, as the gradient pass runs it."""
    if options.router is None:
        return None
    # Under CP each rank routes its piece of every sequence, inside the attention the gradient pass runs.
    pieces = [_cp_piece(mb, None, options)[0] for mb in micro_batches]

    def router_forward(index: int):
        with autocast_context(options, device), _context_parallel(options, micro_batches[index], device):
            return forward(pieces[index]).router_logits  # routed exactly as the gradient pass will route it

    cp_group = options.parallel.cp_group if options.parallel is not None else None
    return begin_router_step(options.router, pieces, router_forward, options.dp_group, device, cp_group)


def _sft_backpropagate(model: nn.Module, micro_batches: list[dict], denominator, options: StepOptions,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, RouterStep | None]:
    """The SFT backward passes: (global loss sum, global router values or None, the step's RouterStep or None)."""
    if pipelined(options):
        return pipeline_backpropagate(model, micro_batches, denominator, options, device)
    router = _router_step(micro_batches, lambda mb: _sft_forward(model, mb, options, device), options, device)
    loss_sum, values = _backpropagate(model, micro_batches, _sft_loss_sum(model, options, device, router),
                                      denominator, options, device, router)
    return loss_sum, values, router


def _router_result(fetched: list[float], router: RouterStep | None) -> RouterValues | None:
    """The host router values of the step; refuses a gradient pass that routed differently from its pre-pass."""
    if router is None:
        return None
    values, mismatch = router_values(fetched, router.settings, router.num_layers())
    check_routing(mismatch)
    return values


def forward_backward(
    model: nn.Module, micro_batches: list[dict], options: StepOptions, device: torch.device
) -> tuple[float, list[int]]:
    """Accumulate gradients of the global-batch loss; return (global loss, global counts). The loss is the whole
    objective (an MoE model's router terms included)."""
    counts = global_counts(micro_batches, options.loss_reduction, device, options.dp_group)
    if pipelined(options):
        loss_sum, values, router = pipeline_backpropagate(model, micro_batches, max(counts[2], 1), options, device)
        result = _router_result(values.tolist(), router) if router is not None else None
        loss = float(loss_sum) / max(counts[2], 1)
        return (loss if result is None else loss + result.objective(router.settings)), counts
    loss, _ = accumulate_objective(model, micro_batches, functools.partial(_sft_loss_sum, model, options, device),
                                   lambda mb: _sft_forward(model, mb, options, device), counts[2], options, device)
    return loss, counts


def _reduce_partial_grads(parameters: list[nn.Parameter]) -> None:
    """TP parameters replicated over ranks that each saw a different part of the input hold partial
    gradients (`Partial` placements): sum them now, once, so the norm and the update see the whole gradient."""
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _copies(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same local values of `grad`: replicas along Replicate mesh axes, and every
    rank outside the gradient's (sub)mesh (e.g. the other DDP replicas of a TP mesh)."""
    if not isinstance(grad, DTensor):
        return world_size
    mesh = grad.device_mesh
    replicated = math.prod(mesh.size(axis) for axis, p in enumerate(grad.placements) if isinstance(p, Replicate))
    return world_size // mesh.size() * replicated


def shared_parameters(model: nn.Module, options: StepOptions) -> list[nn.Parameter]:
    """The parameters of which another pipeline stage holds a copy (a tied embedding: parallel/pp.py)."""
    parallel = options.parallel
    if parallel is None or parallel.dims.pp == 1:
        return []
    return tied_parameters(hf_model(model), parallel.pp_rank, parallel.dims.pp, parallel.dims.pp_schedule)


def grad_norm_squares(parameters: list[nn.Parameter], stages: int = 1,
                      shared: list[nn.Parameter] = ()) -> torch.Tensor:
    """‖g‖² of all gradients over all ranks, an fp64 scalar left on the device:

        ‖g‖² = Σ_ranks Σ_local tensors ‖g_local‖² / copies(g)

    where copies(g) counts the ranks holding the same values (replicas), so every element is counted
    once whatever the layout; one fp64 all-reduce over all ranks, whatever meshes the parameters live on.
    Under pipeline parallelism the `stages` ranks of a pipeline hold different parameters, so a plain tensor is held
    by world size / stages ranks, and the sum over all ranks adds every stage's squares once; a parameter in `shared`
    (a tied embedding, whose copies on the first and last stage hold the same summed gradient) is held by twice as
    many, and counted once.
    Each tensor's norm is taken in fp64 too. In fp32 it would cost a third (3 ms against 9 ms per step for a
    7M-parameter Llama on 2 CPU cores, about 1 % of the step) for a difference of ~1e-7 relative, which is
    enough to move the seeded runs the RL learning tests start from (tests/rl/test_rl_e2e.py): not changed
    until those starts are measured again.
    """
    _reduce_partial_grads(parameters)
    with_grads = [p for p in parameters if p.grad is not None]
    if not with_grads:
        return torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in with_grads]
    world_size = (dist.get_world_size() if dist.is_initialized() else 1) // stages
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64))
    twice = {id(p) for p in shared}
    copies = torch.tensor([_copies(p.grad, world_size) * (2 if id(p) in twice else 1) for p in with_grads],
                          dtype=torch.float64, device=norms.device)
    return all_reduce_sum((norms.square() / copies).sum())


def clip_gradients(parameters: list[nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every gradient by max_norm / (norm + 1e-6) when that is below 1 (max_norm > 0)."""
    if max_norm > 0 and norm > 0:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                     for p in parameters if p.grad is not None]
            torch._foreach_mul_(local, coefficient)


def grad_norm_and_clip(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of all gradients (grad_norm_squares), clipping when max_norm > 0."""
    total = math.sqrt(float(grad_norm_squares(parameters)))
    clip_gradients(parameters, total, max_norm)
    return total


def check_finite(loss: float, grad_norm: float, of: str = "") -> None:
    """Refuse an update computed from a NaN or infinite loss or gradient norm.

    Both values are global (all-reduced) floats already on the host, so every rank refuses the same
    step and the check costs no synchronisation. Raised before the optimizer changes a weight, so the
    weights, and every checkpoint saved before, stay finite. `of`: whose loss ("the critic's ")."""
    for name, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise TrainingError(f"{of or 'the '}{name} is {value}; the run stopped before this update, so the "
                                "weights and every saved checkpoint stay finite; lower train.lr or check the data")


def optimizer_step(optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter], lr: float, grad_clip: float,
                   loss: float, of: str = "", stages: int = 1, shared: list[nn.Parameter] = ()) -> float:
    """Clip and apply the accumulated gradients of `loss` (its global value); returns the gradient norm (over every
    pipeline stage's parameters when `stages` > 1, a tied embedding's two copies counted once: `shared`). Raises
    TrainingError, before any update, when the loss or the norm is not finite."""
    norm = math.sqrt(float(grad_norm_squares(parameters, stages, shared)))
    apply_update(optimizer, parameters, lr, grad_clip, loss, norm, of)
    return norm


def apply_update(optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter], lr: float, grad_clip: float,
                 loss: float, norm: float, of: str = "") -> None:
    """Refuse a non-finite loss or norm, clip to grad_clip, set the lr, step and zero the gradients."""
    check_finite(loss, norm, of)
    clip_gradients(parameters, norm, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict],
    lr: float,
    options: StepOptions,
    device: torch.device,
    before_update=None,
) -> StepResult:
    """forward_backward + optimizer_step with one host sync: the counts, the loss and the gradient norm stay
    on the device until they are fetched together, right before the finiteness check that gates the update.
    `before_update()`, if given, runs between the backward passes and the update (an async checkpoint may
    still be copying the weights the update changes)."""
    counts = _global_counts(micro_batches, options.loss_reduction, device, options.dp_group)
    denominator = counts[2].clamp_min(1)  # an all-masked global batch gives zero gradients, not NaN
    loss_sum, values, router = _sft_backpropagate(model, micro_batches, denominator, options, device)
    if before_update is not None:
        before_update()
    parameters = [p for p in model.parameters() if p.requires_grad]
    stages = options.parallel.dims.pp if options.parallel is not None else 1
    squares = grad_norm_squares(parameters, stages, shared_parameters(model, options)).to(device)
    # The step's one host sync. fp64 holds every count exactly (< 2^53).
    extra = [] if values is None else [values]
    fetched = torch.cat([torch.stack([loss_sum, squares]), counts.double(), *extra]).tolist()
    loss = fetched[0] / max(fetched[4], 1)
    norm = math.sqrt(fetched[1])
    result = _router_result(fetched[6:], router)  # refuses a changed routing before the update
    if result is not None:
        loss += result.objective(router.settings)
    apply_update(optimizer, parameters, lr, options.grad_clip, loss, norm)
    num_input_tokens, num_trained_tokens, _, num_samples = (int(c) for c in fetched[2:6])
    return StepResult(loss=loss, grad_norm=norm, num_input_tokens=num_input_tokens,
                      num_trained_tokens=num_trained_tokens, num_samples=num_samples, router=result)
