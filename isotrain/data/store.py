"""The token store: a dataset's samples as flat arrays on disk, read through memory maps.

    input_ids           [T]      every sample's tokens, one after another, in the smallest unsigned dtype that
                                 holds the vocabulary (uint16 below 65 535 ids, else uint32)
    labels              [T]      the same dtype; its largest value stands for -100 (never a token id)
    sample_offsets      [S + 1]  sample s is tokens [sample_offsets[s], sample_offsets[s + 1])
    doc_lengths         [D]      the documents (rows, or pieces of a row) of all samples, in order
    doc_row_ids         [D]      each document's source row
    sample_doc_offsets  [S + 1]  sample s holds documents [sample_doc_offsets[s], sample_doc_offsets[s + 1])

A sample's position and segment ids follow from its document lengths, so they are not stored. Opening a store
maps the arrays and checks that they agree with each other (vectorised); a sample becomes Python objects
only when it is read, so a run's memory does not grow with the corpus.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from isotrain.data.packing import Sample
from isotrain.data.tokenize import IGNORE_INDEX

ARRAYS = ("input_ids", "labels", "sample_offsets", "doc_lengths", "doc_row_ids", "sample_doc_offsets")


class StoreMismatch(ValueError):
    """The arrays of a store disagree with each other: it was truncated or altered."""


def token_dtype(max_id: int) -> np.dtype:
    """The smallest unsigned dtype whose largest value is above every id (that value marks -100 labels)."""
    return np.dtype(np.uint16) if max_id < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def flatten(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """The store's arrays of `samples` (module docstring)."""
    doc_lengths, doc_row_ids, docs_per_sample = [], [], []
    for sample in samples:
        boundaries = np.flatnonzero(sample.position_ids == 0).tolist() + [len(sample)]
        doc_lengths.extend(np.diff(boundaries).tolist())
        doc_row_ids.extend(sample.row_ids)
        docs_per_sample.append(len(sample.row_ids))
    input_ids = np.concatenate([s.input_ids for s in samples])
    labels = np.concatenate([s.labels for s in samples])
    dtype = token_dtype(int(max(input_ids.max(initial=0), labels.max(initial=0))))
    return {
        "input_ids": input_ids.astype(dtype),
        "labels": np.where(labels == IGNORE_INDEX, np.iinfo(dtype).max, labels).astype(dtype),
        "sample_offsets": np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64),
        "doc_lengths": np.asarray(doc_lengths, dtype=np.int64),
        "doc_row_ids": np.asarray(doc_row_ids, dtype=np.int64),
        "sample_doc_offsets": np.concatenate([[0], np.cumsum(docs_per_sample)]).astype(np.int64),
    }


class TokenStore(Sequence):
    """The samples of a store directory, read on demand from memory-mapped arrays."""

    def __init__(self, directory: Path):
        arrays = {name: np.load(Path(directory) / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                  for name in ARRAYS}
        check_arrays(arrays)
        self._ids, self._labels = arrays["input_ids"], arrays["labels"]
        self._no_label = np.iinfo(self._labels.dtype).max
        # The index arrays are small (8 bytes per sample or document): read once.
        self._offsets = np.asarray(arrays["sample_offsets"])
        self._doc_offsets = np.asarray(arrays["sample_doc_offsets"])
        self._doc_lengths = np.asarray(arrays["doc_lengths"])
        self._doc_row_ids = np.asarray(arrays["doc_row_ids"])

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a store of {len(self)}")
        index %= len(self)
        start, end = self._offsets[index], self._offsets[index + 1]
        first, last = self._doc_offsets[index], self._doc_offsets[index + 1]
        lengths = self._doc_lengths[first:last]
        labels = np.array(self._labels[start:end], dtype=np.int64)  # a copy, not a view of the map
        labels[labels == self._no_label] = IGNORE_INDEX
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        return Sample(
            input_ids=np.array(self._ids[start:end], dtype=np.int64),
            labels=labels,
            position_ids=np.arange(end - start, dtype=np.int64) - starts,
            segment_ids=np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
            row_ids=tuple(int(r) for r in self._doc_row_ids[first:last]),
        )

    def lengths(self) -> np.ndarray:
        """Every sample's number of tokens, without reading a token."""
        return np.diff(self._offsets)


def check_arrays(arrays: dict[str, np.ndarray]) -> None:
    """Raise StoreMismatch unless the arrays describe whole samples of whole documents."""
    offsets, doc_offsets = arrays["sample_offsets"], arrays["sample_doc_offsets"]
    lengths = np.asarray(arrays["doc_lengths"])
    tokens = len(arrays["input_ids"])
    if len(arrays["labels"]) != tokens or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != tokens:
        raise StoreMismatch("the token arrays do not match the sample offsets")
    if len(doc_offsets) != len(offsets) or doc_offsets[0] != 0 or doc_offsets[-1] != len(lengths) \
            or len(arrays["doc_row_ids"]) != len(lengths):
        raise StoreMismatch("the document arrays do not match their offsets")
    if (np.diff(doc_offsets) < 1).any() or (lengths < 1).any():
        raise StoreMismatch("a sample without documents or a document without tokens")
    if not np.array_equal(np.cumsum(lengths)[np.asarray(doc_offsets[1:]) - 1], np.asarray(offsets[1:])):
        raise StoreMismatch("the documents' lengths do not add up to their samples'")
