"""AdamW with decoupled weight decay on matrices only (norm weights, biases excluded)."""

from __future__ import annotations

import torch
from torch import nn

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
    # lr is set before every step by the schedule; foreach keeps the update vectorised on CPU too.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
