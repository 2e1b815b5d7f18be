"""Stack a micro-batch of samples into right-padded tensors.

No attention mask is returned, on purpose. Causal attention already keeps every real token from
seeing the padding after it, and with `attention_mask=None` transformers derives document
boundaries from position ids restarting at 0 (packed samples). So padding must never *restart*
the position ids: it continues counting up from the last real token, which makes it part of the
last document rather than a new one; isotrain's own per-document mask, for families that ignore the
restarts, derives documents by the same rule (models/packing_check.py). (The model must run with
use_cache=False: with a KV cache transformers skips that packed-sequence detection.)
"""

from __future__ import annotations

import numpy as np
import torch

from isotrain.data.packing import Sample
from isotrain.data.tokenize import IGNORE_INDEX


def collate(samples: list[Sample], pad_id: int, length: int | None = None) -> dict:
    """input_ids, labels, position_ids, segment_ids [B, L] (int64) and exact token counts.

    L is the longest sample's length, or `length` when given (a fixed shape, so a compiled model sees one
    shape). Padding: input_ids = pad_id, labels = -100, segment_ids = -1, position_ids continue the last
    document. num_input_tokens counts non-padding tokens; num_trained_tokens counts labels != -100.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    if pad_id is None:
        raise ValueError("collate needs a pad id; load the tokenizer with load_tokenizer, which sets one")
    longest = max(len(sample.input_ids) for sample in samples)
    if length is not None and longest > length:
        raise ValueError(f"a sample of {longest} tokens does not fit the collate length {length}")
    length = longest if length is None else length
    batch = len(samples)
    input_ids = np.full((batch, length), pad_id, dtype=np.int64)
    labels = np.full((batch, length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((batch, length), dtype=np.int64)
    segment_ids = np.full((batch, length), -1, dtype=np.int64)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = sample.input_ids
        labels[row, :n] = sample.labels
        segment_ids[row, :n] = sample.segment_ids
        position_ids[row, :n] = sample.position_ids
        last = sample.position_ids[-1] if n else -1
        position_ids[row, n:] = np.arange(last + 1, last + 1 + length - n)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "num_input_tokens": int(sum(len(sample.input_ids) for sample in samples)),
        "num_trained_tokens": int((labels != IGNORE_INDEX).sum()),
    }
