"""Hidden states of a batch of texts -> one vector per text.

Every mode reads the attention mask, never the padding side: the same text gives the same vector
whether it was padded on the left, on the right, or not at all.
"""

from __future__ import annotations

import torch

from isotrain.errors import ConfigError

POOLING_MODES = ("mean", "cls", "last")


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] position of each row's last non-pad token, for left or right padding.

    With L positions, the last 1 of a row sits at L - 1 - (index of the first 1 in the reversed row)."""
    length = attention_mask.shape[1]
    first_in_reversed = attention_mask.flip(1).to(torch.int64).argmax(dim=1)
    return length - 1 - first_in_reversed


def first_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] position of each row's first non-pad token (0 with right padding)."""
    return attention_mask.to(torch.int64).argmax(dim=1)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [B, L, H], attention_mask [B, L] (1 = token) -> [B, H].

    mean: Σ_t m_t h_t / Σ_t m_t;  cls: the first real token;  last: the last real token (decoder LMs)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "mean":
        weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
    if mode == "cls":
        return hidden[rows, first_token_index(attention_mask)]
    if mode == "last":
        return hidden[rows, last_token_index(attention_mask)]
    raise ConfigError(f"embed.pooling={mode!r} is not a pooling mode; use one of {', '.join(POOLING_MODES)}")
