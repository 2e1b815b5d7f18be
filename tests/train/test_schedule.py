"""LR values at the first step, through warm-up, mid-decay and the last step match the documented formula."""

import math

import pytest

from isotrain.train.schedule import lr_at

PEAK, W, T, R = 1e-3, 10, 110, 0.1


def lr(step, schedule):
    return lr_at(step, lr=PEAK, schedule=schedule, warmup_steps=W, max_steps=T, min_lr_ratio=R)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_starts_above_zero_and_reaches_peak(schedule):
    assert lr(0, schedule) == pytest.approx(PEAK / (W + 1))
    assert lr(4, schedule) == pytest.approx(PEAK * 5 / (W + 1))
    assert lr(W, schedule) == pytest.approx(PEAK)


def test_constant_stays_at_peak():
    assert [lr(s, "constant") for s in (W, 60, T - 1)] == pytest.approx([PEAK] * 3)


def test_linear_decays_to_min_ratio_at_last_step():
    p = (60 - W) / (T - 1 - W)
    assert lr(60, "linear") == pytest.approx(PEAK * (R + (1 - R) * (1 - p)))
    assert lr(T - 1, "linear") == pytest.approx(PEAK * R)


def test_cosine_mid_and_end():
    mid = W + (T - 1 - W) // 2
    p = (mid - W) / (T - 1 - W)
    assert lr(mid, "cosine") == pytest.approx(PEAK * (R + (1 - R) * 0.5 * (1 + math.cos(math.pi * p))))
    assert lr(T - 1, "cosine") == pytest.approx(PEAK * R)


def test_no_warmup_first_step_is_peak():
    assert lr_at(0, lr=PEAK, schedule="cosine", warmup_steps=0, max_steps=T, min_lr_ratio=0.0) == PEAK
