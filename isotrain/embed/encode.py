"""Texts -> pooled vectors, in chunks bounded by a token budget, with dropout keyed per sample.

Train mode is layout-free because no random number depends on the layout: when the model has
active dropout, each text runs on its own (a batch of one, no padding) with the RNG forked and
seeded from (seed, step, global sample index, role), so its masks are the same whichever rank,
micro-batch or chunk holds it, and the same in the no-gradient and the gradient pass of a step.
Without active dropout, a chunk runs as one padded batch (the attention mask hides the padding).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from isotrain.embed.pooling import pool

QUERY, POSITIVE = 0, 1  # roles of a sample's texts; hard negative j has role 2 + j


@dataclass(frozen=True)
class EncodeOptions:
    pooling: str = "mean"
    pad_id: int = 0
    padding_side: str = "right"
    chunk_tokens: int = 0  # padded tokens per forward; 0: a whole micro-batch at once
    seed: int = 0


def text_seed(seed: int, step: int, sample_index: int, role: int) -> int:
    """The RNG seed of one text of one step: a hash of its key, so neighbouring keys share no stream."""
    key = f"{seed}/{step}/{sample_index}/{role}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def has_active_dropout(model: nn.Module) -> bool:
    return model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def chunk_bounds(lengths: list[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) groups of texts whose padded size (count × longest) fits `chunk_tokens`;
    a text longer than the budget is a chunk of its own. 0: one chunk."""
    if chunk_tokens <= 0 or not lengths:
        return [(0, len(lengths))] if lengths else []
    bounds, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, length) > chunk_tokens:
            bounds.append((start, i))
            start, longest = i, 0
        longest = max(longest, length)
    bounds.append((start, len(lengths)))
    return bounds


def pad(token_lists: list[list[int]], pad_id: int, side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest], padded on `side`."""
    longest = max(len(tokens) for tokens in token_lists)
    ids = torch.full((len(token_lists), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), longest), dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        span = slice(0, len(tokens)) if side == "right" else slice(longest - len(tokens), longest)
        ids[row, span] = torch.tensor(tokens, dtype=torch.long)
        mask[row, span] = 1
    return ids.to(device), mask.to(device)


def _forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    # Positions count real tokens only, so a left-padded text sees the positions it has unpadded.
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    hidden = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out[0]
    return pool(hidden, mask, pooling)


def encode_chunk(model: nn.Module, token_lists: list[list[int]], seeds: list[int], options: EncodeOptions,
                 device) -> torch.Tensor:
    """[n, H] pooled vectors of `token_lists` (gradient follows the caller's grad mode)."""
    if not has_active_dropout(model):
        ids, mask = pad(token_lists, options.pad_id, options.padding_side, device)
        return _forward(model, ids, mask, options.pooling)
    vectors = []
    devices = [device] if device.type == "cuda" else []
    for tokens, seed in zip(token_lists, seeds):
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            ids, mask = pad([tokens], options.pad_id, options.padding_side, device)
            vectors.append(_forward(model, ids, mask, options.pooling))
    return torch.cat(vectors)
