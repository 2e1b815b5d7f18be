"""The token store's index while it is written (isotrain/data/store.py StoreWriter): it goes to disk as it grows, so
writing a store holds none of it in memory, and its .npy files are byte for byte what np.save writes for the whole
arrays (a store built before the index was streamed reads the same, and its cache key did not change)."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np

from isotrain.data.store import INDEX_ARRAYS, StoreWriter, TokenStore, write_samples
from isotrain.data.packing import sample_from_documents
from isotrain.data.tokenize import IGNORE_INDEX, Example


def saved(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def test_the_index_files_are_what_np_save_writes_for_the_whole_arrays(tmp_path):
    rng = np.random.default_rng(0)
    documents = [Example(ids, np.where(rng.random(len(ids)) < 0.3, IGNORE_INDEX, ids), row_id=3 * row + 1)
                 for row, ids in enumerate(rng.integers(0, 50, size=int(rng.integers(1, 9))) for _ in range(9))]
    members = [documents[:3], documents[3:4], documents[4:8], documents[8:]]
    write_samples(tmp_path / "store", [sample_from_documents(docs) for docs in members], np.dtype(np.uint16))
    lengths = np.array([len(doc.input_ids) for doc in documents], dtype=np.int64)
    sample_tokens = [sum(len(doc.input_ids) for doc in docs) for docs in members]
    want = {"sample_offsets": np.cumsum([0, *sample_tokens]), "doc_lengths": lengths,
            "doc_row_ids": np.array([doc.row_id for doc in documents], dtype=np.int64),
            "sample_doc_offsets": np.cumsum([0, *map(len, members)])}
    for name in INDEX_ARRAYS:
        assert (tmp_path / "store" / f"{name}.npy").read_bytes() == saved(want[name].astype(np.int64)), name
    assert len(TokenStore(tmp_path / "store")) == 4

    empty = StoreWriter(tmp_path / "empty", np.dtype(np.uint16))
    empty.close()
    assert (tmp_path / "empty" / "sample_offsets.npy").read_bytes() == saved(np.zeros(1, dtype=np.int64))
    assert (tmp_path / "empty" / "doc_lengths.npy").read_bytes() == saved(np.zeros(0, dtype=np.int64))


def test_writing_a_store_holds_none_of_its_index_in_memory(tmp_path):
    """2^20 one-token documents in batches of 2^13 (an index of 32 MiB: 16 bytes per document, 16 per sample):
    what Python and numpy hold at the peak (tracemalloc traces both) stays below 1 MiB, a few batches' arrays."""
    batch = 1 << 13
    writer = StoreWriter(tmp_path / "store", np.dtype(np.uint16))
    tracemalloc.start()
    try:
        for first in range(0, 1 << 20, batch):
            ids = np.arange(first, first + batch, dtype=np.int64) % 60_000
            writer.add_samples(ids, ids, np.ones(batch, dtype=np.int64), np.arange(first, first + batch))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    writer.close()
    assert peak < 1 << 20, peak
    store = TokenStore(tmp_path / "store")
    assert len(store) == 1 << 20 and store[-1].row_ids == ((1 << 20) - 1,)
    assert int(store[12345].input_ids[0]) == 12345
