"""One optimizer step over a rank's micro-batches, with exact global normalisation.

Order of a step (the invariant each stage keeps is in brackets):
  1. count input tokens, trained tokens, loss denominator and samples of every local micro-batch,
     and all-reduce them over DP — before any backward [the loss divides by the global count];
  2. per micro-batch: forward, Σ weighted token losses / global denominator, backward; DDP syncs
     (SUM) only on the last micro-batch [gradient = gradient of the global mean];
  3. all-reduce the summed loss values over DP [the logged loss is the global value];
  4. global grad norm (DTensor-aware), clip, set the lr for this step, optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from isotrain.parallel.dist import all_reduce_sum
from isotrain.train.loss import loss_weights, token_losses


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_input_tokens: int  # global, this step
    num_trained_tokens: int  # global, this step
    num_samples: int  # global, this step


@dataclass(frozen=True)
class StepOptions:
    loss_reduction: str = "token"
    grad_clip: float = 0.0
    autocast_dtype: torch.dtype | None = None  # set for bf16 without FSDP (which casts itself)
    dp_group: object = None


def step_options(cfg, degrees) -> StepOptions:
    """The step settings of a run: FSDP2 casts parameters itself; DDP and single-process runs use autocast for bf16."""
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and degrees.dp_shard == 1 else None
    return StepOptions(loss_reduction=cfg.train.loss_reduction, grad_clip=cfg.train.grad_clip, autocast_dtype=autocast)


def global_counts(micro_batches: list[dict], reduction: str, device: torch.device, group=None) -> list[int]:
    """[input tokens, trained tokens, loss denominator, samples] summed over micro-batches and DP ranks."""
    local = [0, 0, 0, 0]
    for mb in micro_batches:
        _, denominator = loss_weights(mb["labels"], mb["segment_ids"], reduction)
        local[0] += mb["num_input_tokens"]
        local[1] += mb["num_trained_tokens"]
        local[2] += denominator
        local[3] += mb["input_ids"].shape[0]
    counts = all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=device), group)
    return [int(c) for c in counts.tolist()]


def _sync_context(model: nn.Module, is_last: bool):
    """DDP all-reduces gradients only at the last micro-batch; FSDP2 reduce-scatters each one."""
    if isinstance(model, DistributedDataParallel) and not is_last:
        return model.no_sync()
    return contextlib.nullcontext()


def _autocast(options: StepOptions, device: torch.device):
    if options.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=options.autocast_dtype)


def accumulate_gradients(model: nn.Module, micro_batches: list, loss_sum, denominator: float,
                         options: StepOptions, device: torch.device) -> float:
    """Backpropagate Σ_mb loss_sum(mb) / denominator; return the global value of that loss.

    `loss_sum(mb, autocast)` gives one micro-batch's weighted token-loss sum (a scalar with grad),
    running the model forward (only) inside `autocast`, so losses stay in fp32. The
    denominator is already global (all-reduced over DP before any backward), so every micro-batch
    backpropagates its exact share of the global loss and the summed gradient does not depend on
    the split (invariant 1). SFT and RL differ only in `loss_sum` and in how they count.
    """
    denominator = max(denominator, 1)  # an all-masked global batch gives zero gradients, not NaN
    local_loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        with _sync_context(model, i == len(micro_batches) - 1):
            weighted_sum = loss_sum(mb, _autocast(options, device))
            (weighted_sum / denominator).backward()
        local_loss_sum += weighted_sum.detach().double()
    return float(all_reduce_sum(local_loss_sum, options.dp_group)) / denominator


def forward_backward(
    model: nn.Module, micro_batches: list[dict], options: StepOptions, device: torch.device
) -> tuple[float, list[int]]:
    """Accumulate gradients of the global-batch loss; return (global loss, global counts)."""
    counts = global_counts(micro_batches, options.loss_reduction, device, options.dp_group)

    def loss_sum(mb: dict, autocast) -> torch.Tensor:
        labels = mb["labels"].to(device)
        weights, _ = loss_weights(labels, mb["segment_ids"].to(device), options.loss_reduction)
        with autocast:
            # use_cache=False: with a KV cache, transformers stops detecting packed documents.
            logits = model(
                input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device), use_cache=False
            ).logits
        return (token_losses(logits, labels) * weights).sum()

    return accumulate_gradients(model, micro_batches, loss_sum, counts[2], options, device), counts


def grad_norm_and_clip(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of all gradients (sharded DTensors included), clipping when max_norm > 0."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        # Sharded gradients give a partial norm; full_tensor() reduces it over the mesh.
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return float(total)


def optimizer_step(optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter], lr: float, grad_clip: float) -> float:
    norm = grad_norm_and_clip(parameters, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict],
    lr: float,
    options: StepOptions,
    device: torch.device,
    before_update=None,
) -> StepResult:
    """`before_update()`, if given, runs between the backward passes and the update (an async
    checkpoint may still be copying the weights the update changes)."""
    loss, counts = forward_backward(model, micro_batches, options, device)
    if before_update is not None:
        before_update()
    parameters = [p for p in model.parameters() if p.requires_grad]
    norm = optimizer_step(optimizer, parameters, lr, options.grad_clip)
    return StepResult(
        loss=loss, grad_norm=norm, num_input_tokens=counts[0], num_trained_tokens=counts[1], num_samples=counts[3]
    )
