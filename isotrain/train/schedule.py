"""Learning-rate schedule as a pure function of the optimizer step (0-based index of the update).

With peak lr η, W = warmup_steps, T = max_steps, r = min_lr_ratio:

    s < W:  η_s = η · (s + 1) / (W + 1)           the first update already has a non-zero lr
    s ≥ W:  p = (s − W) / max(1, T − 1 − W)        0 at the first decay step, 1 at the last update
            constant: η
            linear:   η · (r + (1 − r)(1 − p))
            cosine:   η · (r + (1 − r) · ½(1 + cos πp))

Stepped once per optimizer step, never per micro-batch, so GA and DP size cannot change it.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - 1 - warmup_steps))
    if schedule == "constant":
        factor = 1.0
    elif schedule == "linear":
        factor = 1.0 - progress
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * factor)


def lr_of_step(train, step: int, max_steps: int | None = None) -> float:
    """`lr_at` with the run's train.* settings; RL passes its number of optimizer steps as `max_steps`
    (train.max_steps counts its RL steps, each of several updates)."""
    return lr_at(step, lr=train.lr, schedule=train.schedule, warmup_steps=train.warmup_steps,
                 max_steps=train.max_steps if max_steps is None else max_steps, min_lr_ratio=train.min_lr_ratio)


def schedule_settings(train) -> dict:
    """The train.* settings `lr_at` depends on, as a checkpoint records them."""
    return {key: getattr(train, key) for key in ("lr", "schedule", "warmup_steps", "max_steps", "min_lr_ratio")}
