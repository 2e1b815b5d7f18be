"""Training samples: one document each, or several whole documents packed into one sequence.

Inside a sample every document restarts its position ids at 0; most transformers families read those
restarts (with no attention mask) as document boundaries and mask attention across them. Families that
do not (OPT) are found by a probe on the run's model before step 1 and get a per-document mask built
from the same restarts (models/packing_check.py). Labels were already shifted per document, so none
crosses a boundary either.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from isotrain.data.tokenize import Example


@dataclass
class Sample:
    input_ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int64 [n], pre-shifted, -100 where not trained
    position_ids: np.ndarray  # int64 [n], 0..len-1 within each document
    segment_ids: np.ndarray  # int64 [n], 0, 1, 2 ... per document inside the sample
    row_ids: tuple[int, ...]  # source row of each document, in sample order

    def __len__(self) -> int:
        return len(self.input_ids)


# A packed sample is an ordinary sample with several segments.
PackedSample = Sample


def sample_from_documents(documents: list[Example]) -> Sample:
    """Concatenate whole documents into one sample."""
    lengths = [len(doc.input_ids) for doc in documents]
    return Sample(
        input_ids=np.concatenate([doc.input_ids for doc in documents]).astype(np.int64, copy=False),
        labels=np.concatenate([doc.labels for doc in documents]).astype(np.int64, copy=False),
        position_ids=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]),
        segment_ids=np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
        row_ids=tuple(doc.row_id for doc in documents),
    )


def to_samples(examples: list[Example]) -> list[Sample]:
    """One single-segment sample per example, in order."""
    return [sample_from_documents([example]) for example in examples]


def pack_examples(examples: list[Example], max_seq_len: int) -> list[PackedSample]:
    """The samples of `pack_plan` over the examples' lengths."""
    plan = pack_plan([len(example.input_ids) for example in examples], max_seq_len)
    return [sample_from_documents([examples[i] for i in members]) for members in plan]


def pack_plan(lengths, max_seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing packing of whole documents into samples of at most `max_seq_len` tokens: for each
    sample, the indices of its documents in ascending order.

    Documents are placed longest first (equal lengths in their original order), each into the
    open sample with the least room that still fits it, else into a new sample; among samples
    with equal room the oldest wins. Everything is decided by lengths and order, so the result is
    deterministic. Documents inside a sample keep their original relative order.
    """
    lengths = [int(n) for n in lengths]
    too_long = [i for i, n in enumerate(lengths) if n > max_seq_len]
    if too_long:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens > max_seq_len={max_seq_len}")
    # sorted() is stable, so ties keep the original order.
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin index), kept sorted
    for i in order:
        slot = bisect.bisect_left(open_bins, (lengths[i], -1))
        if slot < len(open_bins):
            room, b = open_bins.pop(slot)
        else:
            room, b = max_seq_len, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - lengths[i] > 0:
            bisect.insort(open_bins, (room - lengths[i], b))
    return [sorted(members) for members in bins]
