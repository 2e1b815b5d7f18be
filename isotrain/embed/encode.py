"""Texts -> pooled vectors, in chunks bounded by a token budget, with dropout keyed per sample.

A chunk runs as one padded batch (the attention mask hides the padding). Train mode is layout-free because
no random number depends on the layout: each text has a seed from (seed, step, global sample index, role),
and every dropout mask of its row is drawn from that seed over its real positions only (dropout.py), so its
masks are the same whichever rank, micro-batch, chunk or neighbours hold it, and the same in the no-gradient
and the gradient pass of a step.

Mixed precision (model.dtype=bfloat16): the model computes in bf16, cast by FSDP2 when it shards the model, else by
autocast over the fp32 weights (`EncodeOptions.autocast_dtype`), the same in both passes of a step, so the
gradients cached by the first pass are those of the vectors the second pass recomputes. The pooled vectors are
fp32 either way (pooled after an upcast): the contrastive loss and similarities keep their precision (fp64).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from isotrain.embed.dropout import keyed_dropout
from isotrain.embed.pooling import pool

QUERY, POSITIVE = 0, 1  # roles of a sample's texts; hard negative j has role 2 + j


@dataclass(frozen=True)
class EncodeOptions:
    pooling: str = "mean"
    pad_id: int = 0
    padding_side: str = "right"
    chunk_tokens: int = 0  # most padded tokens per forward; 0: no bound
    seed: int = 0
    autocast_dtype: torch.dtype | None = None  # bf16 without FSDP2 (which casts the parameters itself)


def text_seed(seed: int, step: int, sample_index: int, role: int) -> int:
    """The RNG seed of one text of one step: a hash of its key, so neighbouring keys share no stream."""
    key = f"{seed}/{step}/{sample_index}/{role}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


# The fixed cost of one forward/backward (Python, per-layer dispatch), counted in padded tokens of model work;
# measured on all-MiniLM-L6-v2 on one CPU core: a forward of one 16-token text costs about what 30-40 more padded
# tokens in a larger batch cost.
FORWARD_COST_TOKENS = 32


def forward_groups(lengths: list[int], chunk_tokens: int) -> list[list[int]]:
    """Text indices of each forward: the texts sorted by length (stable), cut into consecutive groups that
    minimise the work  Σ_groups (count × longest + FORWARD_COST_TOKENS),  each group's padded size
    count × longest within `chunk_tokens` (0: no bound; a text longer than the bound is a group of its own).

    Sorted groups pad a short text to a short length. Which texts share a forward changes no text's math (the
    padding is masked, dropout is keyed per text), only fp rounding, so the grouping may follow the lengths."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ascending = [lengths[i] for i in order]
    # best[e]: the least work of the first e sorted texts; cut[e]: where the last of its groups starts.
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = ascending[end - 1]
        for start in range(end - 1, -1, -1):
            count = end - start
            if chunk_tokens > 0 and count > 1 and count * longest > chunk_tokens:
                break
            work = best[start] + count * longest + FORWARD_COST_TOKENS
            if work < best[end]:
                best[end], cut[end] = work, start
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def in_text_order(groups: list[list[int]], parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` (one tensor per group of forward_groups) back in the texts' own order."""
    stacked = torch.cat(parts)
    positions = torch.tensor([i for group in groups for i in group], dtype=torch.int64, device=stacked.device)
    return torch.empty_like(stacked).index_copy_(0, positions, stacked)


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


def _autocast(options: EncodeOptions, device):
    if options.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=options.autocast_dtype)


def _forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, options: EncodeOptions, device) -> torch.Tensor:
    # Positions count real tokens only, so a left-padded text sees the positions it has unpadded.
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with _autocast(options, device):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    hidden = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out[0]
    if hidden.dtype.itemsize < 4:  # bf16 hidden states: a mean over hundreds of tokens is summed in fp32
        hidden = hidden.float()
    return pool(hidden, mask, options.pooling)


def encode_chunk(model: nn.Module, token_lists: list[list[int]], seeds: list[int], options: EncodeOptions,
                 device) -> torch.Tensor:
    """[n, H] pooled vectors of `token_lists`, one padded forward (gradient follows the caller's grad mode);
    in train mode, text i's dropout masks are keyed by `seeds[i]`."""
    ids, mask = pad(token_lists, options.pad_id, options.padding_side, device)
    if not model.training:
        return _forward(model, ids, mask, options, device)
    with keyed_dropout(model, seeds, mask):
        return _forward(model, ids, mask, options, device)
