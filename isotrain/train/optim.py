"""AdamW with decoupled weight decay on matrices only (norm weights, biases excluded)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from isotrain.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # lr is set before every step by the schedule. The fused kernel updates each parameter in one pass
    # (measured on 2 CPU cores: 12 ms against 49 ms for foreach on a 7M-parameter Llama); foreach where
    # torch has no fused kernel for the parameters' device. Both compute AdamW's update to fp rounding.
    fused = all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None,
                             foreach=None if fused else True)
