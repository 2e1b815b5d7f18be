"""The shared optimizer step refuses a non-finite loss or gradient norm before it changes a weight."""

from __future__ import annotations

import pytest
import torch

from isotrain.errors import TrainingError
from isotrain.train.step import optimizer_step


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def backward(model, scale: float) -> float:
    loss = model(torch.ones(3, 4)).square().sum() * scale
    loss.backward()
    return float(loss.detach())


@pytest.mark.parametrize("scale, loss_value, expected", [
    (1.0, float("nan"), "the loss is nan"),
    (float("inf"), None, "the loss is inf"),  # an infinite loss: its gradients are inf/nan too
    (1.0, None, None),
])
def test_optimizer_step_refuses_non_finite_values_before_the_update(scale, loss_value, expected):
    model, optimizer = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    loss = backward(model, scale)
    if loss_value is not None:
        loss = loss_value
    if expected is None:
        optimizer_step(optimizer, list(model.parameters()), 1e-2, grad_clip=1.0, loss=loss)
        assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        return
    with pytest.raises(TrainingError, match=f"^{expected}; the run stopped before this update"):
        optimizer_step(optimizer, list(model.parameters()), 1e-2, grad_clip=1.0, loss=loss)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not optimizer.state  # the optimizer never stepped


def test_a_non_finite_gradient_with_a_finite_loss_is_refused():
    model, optimizer = model_and_optimizer()
    loss = backward(model, 1.0)
    model.weight.grad[0, 0] = float("inf")
    with pytest.raises(TrainingError, match=r"^the critic's gradient norm is inf; .* lower train.lr or check the data$"):
        optimizer_step(optimizer, list(model.parameters()), 1e-2, grad_clip=0.0, loss=loss, of="the critic's ")
    assert torch.isfinite(model.weight).all() and not optimizer.state
