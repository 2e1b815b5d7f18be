"""The token store: a dataset's samples as flat arrays on disk, read through memory maps.

    input_ids.bin       [T]      every sample's tokens, one after another, raw, in the smallest unsigned dtype
                                 that holds the vocabulary (uint16 below 65 535 ids, else uint32; store.json)
    labels.bin          [T]      the same dtype; its largest value stands for -100 (never a token id)
    sample_offsets      [S + 1]  sample s is tokens [sample_offsets[s], sample_offsets[s + 1])
    doc_lengths         [D]      the documents (rows, or pieces of a row) of all samples, in order
    doc_row_ids         [D]      each document's source row
    sample_doc_offsets  [S + 1]  sample s holds documents [sample_doc_offsets[s], sample_doc_offsets[s + 1])
    checksums           [2, B]   crc32 of each CHECK_BLOCK_BYTES block of input_ids.bin (row 0), labels.bin (row 1)

The index arrays and the checksums are .npy files. A sample's position and segment ids follow from its document lengths,
so they are not stored. `StoreWriter` appends samples and their index to the files as they come: neither the corpus
nor its index is held in memory while a store is written (what it keeps grows by 8 bytes per MiB of tokens, the
block checksums). Opening a store maps the token files and checks that the arrays agree with each other
(vectorised); a sample becomes Python objects only when it is read, so a run's memory does not grow with the corpus.

The token files are checked against their checksums block by block: all at once when a store opens if they hold
at most EAGER_CHECK_BYTES, otherwise each block the first time a sample in it is read (crc32 runs at about
3 GB/s here: checking 4 GB of tokens at every start would cost more than the rest of a warm start). Either way
no token is returned before its block matched; a block that does not match raises StoreMismatch.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from isotrain.data.packing import Sample
from isotrain.data.tokenize import IGNORE_INDEX, Example

TOKEN_FILES = ("input_ids.bin", "labels.bin")
INDEX_ARRAYS = ("sample_offsets", "doc_lengths", "doc_row_ids", "sample_doc_offsets")
FILES = (*TOKEN_FILES, *(f"{name}.npy" for name in INDEX_ARRAYS), "checksums.npy", "store.json")
CHECK_BLOCK_BYTES = 1 << 20
EAGER_CHECK_BYTES = 256 << 20  # token bytes (both files) checked when a store opens: about 0.1 s


class StoreMismatch(ValueError):
    """The arrays of a store disagree with each other: it was truncated or altered."""


def token_dtype(max_id: int) -> np.dtype:
    """The smallest unsigned dtype whose largest value is above every id (that value marks -100 labels)."""
    return np.dtype(np.uint16) if max_id < np.iinfo(np.uint16).max else np.dtype(np.uint32)


class StoreWriter:
    """Writes a store into `directory` one sample at a time; `close()` writes the index and store.json."""

    def __init__(self, directory: Path, dtype: np.dtype):
        self.directory, self.dtype = Path(directory), np.dtype(dtype)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._no_label = np.iinfo(self.dtype).max
        self._ids = (self.directory / "input_ids.bin").open("wb")
        self._labels = (self.directory / "labels.bin").open("wb")
        self._sums = (_BlockSums(), _BlockSums())
        # The index goes to disk as it grows, like the tokens: preparing holds none of it in memory.
        self._sample_offsets, self._doc_offsets = (_IndexFile(self.directory / f"{name}.npy", first=0)
                                                   for name in ("sample_offsets", "sample_doc_offsets"))
        self._doc_lengths, self._doc_row_ids = (_IndexFile(self.directory / f"{name}.npy")
                                                for name in ("doc_lengths", "doc_row_ids"))

    def add(self, documents: Sequence[Example]) -> None:
        """One sample made of `documents`, in order (positions restart at each)."""
        self.add_samples(np.concatenate([np.asarray(doc.input_ids, dtype=np.int64) for doc in documents]),
                         np.concatenate([np.asarray(doc.labels, dtype=np.int64) for doc in documents]),
                         np.array([len(doc.input_ids) for doc in documents], dtype=np.int64),
                         np.array([doc.row_id for doc in documents], dtype=np.int64),
                         np.array([len(documents)], dtype=np.int64))

    def add_samples(self, ids: np.ndarray, labels: np.ndarray, doc_lengths: np.ndarray, doc_row_ids: np.ndarray,
                    docs_per_sample: np.ndarray | None = None) -> None:
        """Many samples at once, flat: their documents' tokens back to back, `docs_per_sample` documents each (one
        if None). `ids` and `labels` are int64 (labels -100 where not trained) or already `encode`d."""
        if ids.dtype != self.dtype:
            ids, labels = self.encode(ids, labels)
        for handle, sums, values in zip((self._ids, self._labels), self._sums, (ids, labels)):
            data = values.tobytes()
            handle.write(data)
            sums.update(data)
        docs_per_sample = np.ones(len(doc_lengths), dtype=np.int64) if docs_per_sample is None else docs_per_sample
        sample_tokens = np.add.reduceat(doc_lengths, np.cumsum(docs_per_sample) - docs_per_sample) \
            if len(doc_lengths) else np.zeros(0, dtype=np.int64)
        self._sample_offsets.append(self._sample_offsets.last + np.cumsum(sample_tokens, dtype=np.int64))
        self._doc_offsets.append(self._doc_offsets.last + np.cumsum(docs_per_sample, dtype=np.int64))
        self._doc_lengths.append(doc_lengths)
        self._doc_row_ids.append(doc_row_ids)

    def encode(self, ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 ids and labels in the store's dtype, -100 labels as its largest value."""
        if len(ids) and int(ids.max()) >= self._no_label:
            raise ValueError(f"token id {int(ids.max())} does not fit the store's {self.dtype}")
        return ids.astype(self.dtype), np.where(labels == IGNORE_INDEX, self._no_label, labels).astype(self.dtype)

    @property
    def num_samples(self) -> int:
        return self._sample_offsets.count - 1

    def close(self) -> None:
        for handle in (self._ids, self._labels):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        for index_file in (self._sample_offsets, self._doc_lengths, self._doc_row_ids, self._doc_offsets):
            index_file.close()
        np.save(self.directory / "checksums.npy", np.stack([sums.finish() for sums in self._sums]), allow_pickle=False)
        (self.directory / "store.json").write_text(json.dumps({"token_dtype": self.dtype.name,
                                                               "check_block_bytes": CHECK_BLOCK_BYTES}))


class _IndexFile:
    """A 1-D int64 .npy file written as its values come, holding only its length and last value in memory. Its
    header is written again for the final length on `close`: numpy pads a 1-D header so that every length takes the
    same bytes (NPY_HEADER_BYTES), so the file is byte for byte what np.save writes for the whole array."""

    def __init__(self, path: Path, first: int | None = None):
        self.path, self.count, self.last = path, 0, 0
        self._handle = path.open("wb")
        self._handle.write(_npy_header(0))
        if first is not None:
            self.append(np.array([first], dtype=np.int64))

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        if len(values):
            self._handle.write(values.tobytes())
            self.count, self.last = self.count + len(values), int(values[-1])

    def close(self) -> None:
        self._handle.seek(0)
        self._handle.write(_npy_header(self.count))
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


NPY_HEADER_BYTES = 128  # what numpy's format 1.0 writes for any 1-D int64 array


def _npy_header(length: int) -> bytes:
    """The .npy header np.save writes for a 1-D int64 array of `length` values."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)),
                                                  "fortran_order": False, "shape": (length,)})
    header = buffer.getvalue()
    if len(header) != NPY_HEADER_BYTES:  # a numpy whose header does not keep its size could not be rewritten
        raise RuntimeError(f"numpy {np.__version__} writes a {len(header)}-byte .npy header for {length} values, "
                           f"not {NPY_HEADER_BYTES}: the store's index cannot be appended to in place")
    return header


class _BlockSums:
    """crc32 of each CHECK_BLOCK_BYTES block of a file written in pieces of any size."""

    def __init__(self):
        self.sums, self.crc, self.filled = array("I"), 0, 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), CHECK_BLOCK_BYTES - self.filled)
            self.crc, self.filled, view = zlib.crc32(view[:take], self.crc), self.filled + take, view[take:]
            if self.filled == CHECK_BLOCK_BYTES:
                self.sums.append(self.crc)
                self.crc = self.filled = 0

    def finish(self) -> np.ndarray:
        if self.filled:
            self.sums.append(self.crc)
            self.crc = self.filled = 0
        return np.frombuffer(self.sums, dtype=np.uint32).copy()


def write_samples(directory: Path, samples: Sequence[Sample], dtype: np.dtype) -> None:
    """A store of `samples` (each split back into its documents by its position restarts)."""
    writer = StoreWriter(directory, dtype)
    for sample in samples:
        writer.add(sample_documents(sample))
    writer.close()


def sample_documents(sample: Sample) -> list[Example]:
    """The documents of `sample`, found at its position restarts."""
    starts = np.flatnonzero(sample.position_ids == 0).tolist() + [len(sample)]
    return [Example(sample.input_ids[a:b], sample.labels[a:b], row_id)
            for a, b, row_id in zip(starts[:-1], starts[1:], sample.row_ids)]


class TokenStore(Sequence):
    """The samples of a store directory, read on demand from memory-mapped arrays."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        meta = json.loads((directory / "store.json").read_text())
        dtype = np.dtype(meta["token_dtype"])
        if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise StoreMismatch(f"token dtype {dtype} is not uint16 or uint32")
        arrays = {name: _map(directory / name, dtype) for name in TOKEN_FILES}
        # The index (8 bytes per sample, 16 per document) is read into memory once.
        arrays.update({name: np.load(directory / f"{name}.npy", allow_pickle=False) for name in INDEX_ARRAYS})
        check_arrays(arrays)
        self._ids, self._labels = arrays["input_ids.bin"], arrays["labels.bin"]
        self._blocks = _Blocks(tuple(directory / name for name in TOKEN_FILES), self._ids.nbytes,
                               np.load(directory / "checksums.npy", allow_pickle=False), int(meta["check_block_bytes"]))
        if 2 * self._ids.nbytes <= EAGER_CHECK_BYTES:
            self._blocks.check(0, self._ids.nbytes)
        self._no_label = np.iinfo(dtype).max
        self._offsets, self._doc_offsets = arrays["sample_offsets"], arrays["sample_doc_offsets"]
        self._doc_lengths, self._doc_row_ids = arrays["doc_lengths"], arrays["doc_row_ids"]

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
        itemsize = self._ids.itemsize
        self._blocks.check(int(start) * itemsize, int(end) * itemsize)
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

    def documents(self, index: int) -> list[Example]:
        """The documents of sample `index`, as tokenization made them."""
        return sample_documents(self[index])

    def lengths(self) -> np.ndarray:
        """Every sample's number of tokens, without reading a token."""
        return np.diff(self._offsets)

    def trained_counts(self, chunk_tokens: int = 1 << 22) -> np.ndarray:
        """Every sample's number of trained tokens (labels != -100): one pass over the labels, `chunk_tokens` at a
        time (each block checked against its checksum first), so the memory it needs does not grow with the store."""
        counts = np.zeros(len(self), dtype=np.int64)
        first, itemsize = 0, self._labels.itemsize
        while first < len(self):
            last = int(np.searchsorted(self._offsets, self._offsets[first] + chunk_tokens, side="right")) - 1
            last = min(max(last, first + 1), len(self))
            a, b = int(self._offsets[first]), int(self._offsets[last])
            self._blocks.check(a * itemsize, b * itemsize)
            trained = np.concatenate([[0], np.cumsum(np.asarray(self._labels[a:b]) != self._no_label)])
            counts[first:last] = trained[self._offsets[first + 1 : last + 1] - a] - trained[self._offsets[first:last] - a]
            first = last
        return counts


class _Blocks:
    """Which blocks of the token files have matched their checksums in this process; checks the others on demand.
    Blocks are read from the files, not through the maps, so that checking a store does not make its pages part of
    the process's resident memory."""

    def __init__(self, paths: tuple[Path, Path], size: int, sums: np.ndarray, block_bytes: int):
        if block_bytes < 1 or sums.shape != (2, -(-size // block_bytes)):
            raise StoreMismatch(f"checksums.npy holds {sums.shape} checksums, not 2 x {-(-size // block_bytes)}")
        self.paths, self.size, self.sums, self.block_bytes = paths, size, sums, block_bytes
        self.matched = np.zeros(sums.shape[1], dtype=bool)

    def check(self, start: int, end: int) -> None:
        """Check the blocks holding bytes [start, end) of both files, unless they matched before."""
        if end <= start:
            return
        first, last = start // self.block_bytes, (end - 1) // self.block_bytes
        blocks = (np.flatnonzero(~self.matched[first : last + 1]) + first).tolist()
        if not blocks:
            return
        for name, path, sums in zip(TOKEN_FILES, self.paths, self.sums):
            with path.open("rb", buffering=0) as handle:
                for block in blocks:
                    a = block * self.block_bytes
                    if zlib.crc32(os.pread(handle.fileno(), self.block_bytes, a)) != int(sums[block]):
                        raise StoreMismatch(f"block {block} of {name} (bytes {a}-{min(a + self.block_bytes, self.size)})"
                                            " does not match its checksum")
        self.matched[blocks] = True


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise StoreMismatch(f"{path.name} holds {size} bytes, not a whole number of {dtype} tokens")
    if size == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def check_arrays(arrays: dict[str, np.ndarray]) -> None:
    """Raise StoreMismatch unless the arrays describe whole samples of whole documents."""
    offsets, doc_offsets = arrays["sample_offsets"], arrays["sample_doc_offsets"]
    lengths = arrays["doc_lengths"]
    tokens = len(arrays["input_ids.bin"])
    if len(arrays["labels.bin"]) != tokens or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != tokens:
        raise StoreMismatch("the token arrays do not match the sample offsets")
    if len(doc_offsets) != len(offsets) or doc_offsets[0] != 0 or doc_offsets[-1] != len(lengths) \
            or len(arrays["doc_row_ids"]) != len(lengths):
        raise StoreMismatch("the document arrays do not match their offsets")
    if (np.diff(doc_offsets) < 1).any() or (lengths < 1).any():
        raise StoreMismatch("a sample without documents or a document without tokens")
    if not np.array_equal(np.cumsum(lengths)[doc_offsets[1:] - 1], offsets[1:]):
        raise StoreMismatch("the documents' lengths do not add up to their samples'")
