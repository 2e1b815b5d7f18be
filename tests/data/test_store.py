"""The token store (isotrain/data/store.py): samples written as flat arrays read back the same through memory
maps, in the smallest token dtype; arrays that disagree are refused; opening a store costs memory for its
index only, however many tokens it holds."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest

from helpers import subprocess_env
from isotrain.data.packing import sample_from_documents
import isotrain.data.store as store_module
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


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["input_ids.bin", "labels.bin"])
def test_a_flipped_token_bit_of_a_small_store_is_refused_when_it_opens(tmp_path, name):
    write_samples(tmp_path / "store", samples_of(50), np.dtype(np.uint16))
    TokenStore(tmp_path / "store")
    flip(tmp_path / "store" / name, 40)
    with pytest.raises(StoreMismatch, match=f"block 0 of {name} \\(bytes 0-92\\) does not match its checksum"):
        TokenStore(tmp_path / "store")


def test_a_large_store_checks_each_block_before_its_first_sample_is_returned(tmp_path, monkeypatch):
    """Past EAGER_CHECK_BYTES a store opens without reading its tokens; a damaged block is refused when a sample
    in it is first read, and the samples of the other blocks still read."""
    monkeypatch.setattr(store_module, "CHECK_BLOCK_BYTES", 16)  # 8 uint16 tokens; recorded in store.json
    samples = samples_of(50)  # samples of 19, 11 and 16 tokens: bytes 0-38, 38-60, 60-92
    write_samples(tmp_path / "store", samples, np.dtype(np.uint16))
    monkeypatch.setattr(store_module, "EAGER_CHECK_BYTES", 0)
    flip(tmp_path / "store" / "labels.bin", 70)  # block 4: bytes 64-80, in the last sample
    store = TokenStore(tmp_path / "store")
    assert np.array_equal(store[0].input_ids, samples[0].input_ids)
    assert np.array_equal(store[1].labels, samples[1].labels)
    with pytest.raises(StoreMismatch, match=r"block 4 of labels.bin \(bytes 64-80\) does not match"):
        store[2]
    with pytest.raises(StoreMismatch):
        store[-1]  # never marked as checked


def test_checksums_for_another_length_are_refused(tmp_path):
    write_samples(tmp_path / "store", samples_of(50), np.dtype(np.uint16))
    np.save(tmp_path / "store" / "checksums.npy", np.zeros((2, 3), dtype=np.uint32))
    with pytest.raises(StoreMismatch, match=r"checksums.npy holds \(2, 3\) checksums, not 2 x 1"):
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
    block = 1 << 20
    data = ids.tobytes()
    sums = np.array([zlib.crc32(data[a : a + block]) for a in range(0, len(data), block)], dtype=np.uint32)
    np.save(directory / "checksums.npy", np.stack([sums, sums]), allow_pickle=False)
    (directory / "store.json").write_text(json.dumps({"token_dtype": "uint16", "check_block_bytes": block}))


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
