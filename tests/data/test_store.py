"""The token store (isotrain/data/store.py): samples written as flat arrays read back the same through memory
maps, in the smallest token dtype; arrays that disagree are refused; opening a store costs memory for its
index only, however many tokens it holds."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import subprocess_env
from isotrain.data.packing import sample_from_documents
from isotrain.data.store import FILES, StoreMismatch, TokenStore, token_dtype, write_samples
from isotrain.data.tokenize import IGNORE_INDEX, Example


def samples_of(max_id: int):
    rng = np.random.default_rng(0)
    documents = []
    for row in range(7):
        ids = rng.integers(0, max_id + 1, size=int(rng.integers(1, 12)))
        labels = np.where(rng.random(len(ids)) < 0.3, IGNORE_INDEX, ids)
        documents.append(Example(ids, labels, row_id=10 + row))
    documents[-1].input_ids[0] = max_id  # the largest id decides the dtype
    return [sample_from_documents(documents[:3]), sample_from_documents(documents[3:4]),
            sample_from_documents(documents[4:])]


def write_index(directory, arrays: dict) -> None:
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", array, allow_pickle=False)


@pytest.mark.parametrize(("max_id", "dtype"), [(9, np.uint16), (65534, np.uint16), (65535, np.uint32),
                                               (200_000, np.uint32)])
def test_samples_read_back_equal_in_the_smallest_dtype(tmp_path, max_id, dtype):
    samples = samples_of(max_id)
    assert token_dtype(max_id) == dtype
    write_samples(tmp_path / "store", samples, token_dtype(max_id))
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(FILES)
    assert (tmp_path / "store" / "input_ids.bin").stat().st_size == sum(map(len, samples)) * np.dtype(dtype).itemsize
    store = TokenStore(tmp_path / "store")
    assert len(store) == 3 and list(store.lengths()) == [len(s) for s in samples]
    for got, want in zip([*store[:2], store[-1]], samples):
        for name in ("input_ids", "labels", "position_ids", "segment_ids"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
            assert type(getattr(got, name)) is np.ndarray and getattr(got, name).dtype == np.int64
        assert got.row_ids == want.row_ids
    with pytest.raises(IndexError):
        store[3]


def test_an_id_beyond_the_dtype_is_refused_when_written(tmp_path):
    with pytest.raises(ValueError, match="token id 65535 does not fit the store's uint16"):
        write_samples(tmp_path / "store", samples_of(65535), np.dtype(np.uint16))


def shorten(path, drop_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:-drop_bytes])


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda d: shorten(d / "input_ids.bin", 1), "input_ids.bin holds 91 bytes, not a whole number of uint16"),
    (lambda d: shorten(d / "labels.bin", 2), "the token arrays do not match the sample offsets"),
    (lambda d: write_index(d, {"doc_lengths": np.load(d / "doc_lengths.npy") + np.eye(7, dtype=np.int64)[0]}),
     "the documents' lengths do not add up"),
    (lambda d: write_index(d, {"sample_doc_offsets": np.array([0, 3, 3, 7])}), "a sample without documents"),
    (lambda d: write_index(d, {"sample_doc_offsets": np.array([0, 3, 4])}),
     "the document arrays do not match their offsets"),
    (lambda d: write_index(d, {"doc_row_ids": np.arange(6)}), "the document arrays do not match their offsets"),
    (lambda d: (d / "store.json").write_text('{"token_dtype": "int8"}'), "token dtype int8 is not uint16 or uint32"),
])
def test_arrays_that_disagree_are_refused(tmp_path, damage, reason):
    samples = samples_of(50)
    write_samples(tmp_path / "store", samples, np.dtype(np.uint16))
    assert sum(map(len, samples)) == 46  # 92 bytes of uint16 ids: the byte count above
    damage(tmp_path / "store")
    with pytest.raises(StoreMismatch, match=reason):
        TokenStore(tmp_path / "store")


OPEN_AND_READ = """
import json, sys
import numpy as np
from isotrain.data.store import TokenStore

def anonymous_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

before = anonymous_kib()
store = TokenStore(sys.argv[1])
read = [store[int(i)] for i in np.linspace(0, len(store) - 1, 200)]
print(json.dumps({"samples": len(store), "anonymous_kib": anonymous_kib() - before}))
"""


def synthetic_store(directory, num_samples: int, tokens_per_sample: int) -> None:
    """A store of packed-looking samples (4 documents each) written without tokenizing anything."""
    directory.mkdir()
    ids = (np.arange(num_samples * tokens_per_sample) % 30000).astype(np.uint16)
    ids.tofile(directory / "input_ids.bin")
    ids.tofile(directory / "labels.bin")
    docs = np.full(4 * num_samples, tokens_per_sample // 4, dtype=np.int64)
    write_index(directory, {"sample_offsets": np.arange(num_samples + 1) * tokens_per_sample, "doc_lengths": docs,
                            "doc_row_ids": np.arange(len(docs)), "sample_doc_offsets": np.arange(num_samples + 1) * 4})
    (directory / "store.json").write_text(json.dumps({"token_dtype": "uint16"}))


@pytest.mark.slow
def test_opening_a_store_takes_memory_for_its_index_not_its_tokens(tmp_path):
    """Two stores of 2 M and 32 M tokens (the second about 0.13 GB of text's worth, 64 MiB of ids): the memory a
    process allocates to open each and read 200 samples spread over it differs by the index only (8 bytes per
    sample, 16 per document: about 1 MiB here), not the 60 MiB more of ids. Anonymous memory is measured: the
    pages of the mapped files the reads touch are the kernel's cache, given back under pressure."""
    usage = {}
    for name, num_samples in (("small", 1_000), ("large", 16_000)):
        synthetic_store(tmp_path / name, num_samples, 2048)
        proc = subprocess.run([sys.executable, "-c", OPEN_AND_READ, str(tmp_path / name)], env=subprocess_env(),
                              capture_output=True, text=True, check=True)
        usage[name] = json.loads(proc.stdout.splitlines()[-1])
    assert (usage["small"]["samples"], usage["large"]["samples"]) == (1_000, 16_000)
    grown_mib = (usage["large"]["anonymous_kib"] - usage["small"]["anonymous_kib"]) / 1024
    assert grown_mib < 8, usage
