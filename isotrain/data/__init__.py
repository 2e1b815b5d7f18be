"""Training data: sources, tokenization with pre-shifted labels, packing, caching, the sampler.

The trainer calls `prepare_dataset` once, then per step asks `GlobalBatchSampler` for its
micro-batches' indices and `collate`s the samples.
"""

from isotrain.data.collate import collate
from isotrain.data.dataset import DataStats, Dataset, build_store, prepare_dataset
from isotrain.data.packing import PackedSample, Sample, pack_examples, to_samples
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import RowsResult, read_rows
from isotrain.data.tokenize import Example, TokenizeStats, tokenize_rows

__all__ = [
    "DataStats",
    "Dataset",
    "Example",
    "GlobalBatchSampler",
    "PackedSample",
    "RowsResult",
    "Sample",
    "TokenizeStats",
    "build_store",
    "collate",
    "pack_examples",
    "prepare_dataset",
    "read_rows",
    "to_samples",
    "tokenize_rows",
]
