"""Pooling against hand-computed values, with left and right padding."""

import pytest
import torch

from isotrain.embed.pooling import last_token_index, pool
from isotrain.errors import ConfigError

# Two texts: 3 tokens and 2 tokens, hidden size 2; values chosen by hand.
TEXT_A = [[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]]
TEXT_B = [[-1.0, 0.5], [7.0, 1.5]]
PAD = [100.0, -100.0]  # a pad position's hidden state must never leak into a pooled vector


def batch(side):
    if side == "right":
        hidden = torch.tensor([TEXT_A, TEXT_B + [PAD]])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    else:
        hidden = torch.tensor([TEXT_A, [PAD] + TEXT_B])
        mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    return hidden, mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_pooling_by_hand(side):
    hidden, mask = batch(side)
    assert pool(hidden, mask, "mean").tolist() == [[3.0, 5.0], [3.0, 1.0]]
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 2.0], [-1.0, 0.5]]
    assert pool(hidden, mask, "last").tolist() == [[5.0, 9.0], [7.0, 1.5]]


def test_last_token_index_both_sides():
    assert last_token_index(torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])).tolist() == [1, 3, 3]


def test_unknown_pooling_is_refused():
    hidden, mask = batch("right")
    with pytest.raises(ConfigError, match="embed.pooling='max' is not a pooling mode"):
        pool(hidden, mask, "max")
