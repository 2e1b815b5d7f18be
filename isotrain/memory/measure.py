"""The estimate's terms measured on a live rank: bytes of the real tensors, one storage counted once.

Model states are read from the tensors themselves (a DTensor's local shard, FSDP2's padded shard storage);
activations with the same saved-tensor counter the estimate uses (memory/saved.py), around a real forward
of the SFT step's loss.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from isotrain.memory.saved import _local, count_saved, forward_loss
from isotrain.parallel.apply import decoder_layers


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local part)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def parameter_bytes(model: nn.Module) -> int:
    return storage_bytes(p for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def activation_bytes(model: nn.Module, micro_batch: dict, autocast_dtype, loss_parallel: bool,
                     router=None) -> dict[str, int]:
    """What a real forward of `micro_batch` keeps for backward, by kind, plus the logits (memory/saved.py)."""
    from isotrain.models.unwrap import hf_model
    from isotrain.train.loss import loss_weights

    labels = micro_batch["labels"]
    weights, _ = loss_weights(labels, micro_batch["segment_ids"], "token")
    parallel_loss = contextlib.nullcontext()
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as parallel_loss_context

        parallel_loss = parallel_loss_context()
    with parallel_loss:
        inner = hf_model(model)  # the Hugging Face model inside a DDP wrapper
        with count_saved(inner, decoder_layers(inner)) as saved:
            loss = forward_loss(model, micro_batch["input_ids"], micro_batch["position_ids"], labels, weights,
                                autocast_dtype, router=router, saved=saved)
        loss.backward()  # frees what was counted (FSDP2 also expects the backward of every forward)
    result = dict(saved.by_kind)
    result["logits"] = saved.logits_bytes
    result["logits_numel"] = saved.logits_numel
    result["logits_fp32"] = saved.logits_dtype == torch.float32
    return result
