"""AdamW with decoupled weight decay on matrices only (norm weights, biases excluded)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from isotrain.config import TrainConfig


def _mesh(param: torch.Tensor):
    return param.device_mesh if isinstance(param, DTensor) else None


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """One group per (weight decay, device mesh): torch's AdamW updates a group in one call, which cannot mix
    plain tensors and DTensors or DTensors of different meshes (expert-parallel experts next to FSDP2 or DDP
    parameters). With one mesh or none: the matrices, then the rest."""
    groups: dict[tuple, dict] = {}
    for decay in (True, False):
        for param in model.parameters():
            if param.requires_grad and (param.ndim >= 2) == decay:
                key = (decay, _mesh(param))
                groups.setdefault(key, {"params": [], "weight_decay": cfg.weight_decay if decay else 0.0})
                groups[key]["params"].append(param)
    groups = list(groups.values()) or [{"params": [], "weight_decay": 0.0}]
    # lr is set before every step by the schedule. The fused kernel updates each parameter in one pass
    # (measured on 2 CPU cores: 12 ms against 49 ms for foreach on a 7M-parameter Llama); foreach where
    # torch has no fused kernel for the parameters' device. Both compute AdamW's update to fp rounding.
    fused = all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None,
                             foreach=None if fused else True)
