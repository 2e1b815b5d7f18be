"""Preparing a corpus (data/dataset.py build_store, data/tokenize.py tokenize_chunk): the whole-array cuts equal a
row-by-row reference, and the store does not depend on how rows were chunked; packing plans over windows of
PACK_WINDOW_TOKENS, each packed as pack_examples packs its examples."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import subprocess_env
import isotrain.data.dataset as dataset_module
from isotrain.config import SFTDataConfig
from isotrain.data.dataset import build_store
from isotrain.data.packing import pack_examples, to_samples
from isotrain.data.store import TokenStore
from isotrain.data.tokenize import IGNORE_INDEX, Example, shifted_labels, tokenize_rows
from isotrain.models.tokenizer import train_tokenizer

L = 8
ALPHABET = "abcdefghij+="


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([ALPHABET], "char", 64)


def random_rows(seed: int, count: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list(ALPHABET), size=int(n))) for n in rng.integers(1, 30, size=2 * count)]
    return [{"text": texts[2 * i], "prompt": texts[2 * i + 1], "completion": texts[2 * i][:5]} for i in range(count)]


def reference(rows, row_ids, tok, fmt, max_seq_len, overflow) -> tuple[list[Example], list[tuple[int, str]]]:
    """Row by row, as the module docstring of data/tokenize.py states the rules."""
    bos, eos = [tok.bos_token_id], [tok.eos_token_id]
    examples, skipped = [], []
    for row_id, row in zip(row_ids, rows):
        if fmt == "text":
            body = tok(row["text"], add_special_tokens=False)["input_ids"]
            ids, targets = bos + body + eos, [False] + [True] * (len(body) + 1)
        else:
            prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
            completion = tok(row["completion"], add_special_tokens=False)["input_ids"]
            ids = bos + prompt + completion + eos
            targets = [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
        labels = shifted_labels(ids, targets)
        ids = np.asarray(ids)
        if len(ids) <= max_seq_len:
            pieces = [(ids, labels)]
        elif overflow == "drop":
            skipped.append((row_id, f"{len(ids)} tokens > data.max_seq_len={max_seq_len} (data.overflow=drop)"))
            continue
        elif overflow == "split":
            pieces = [(ids[k : k + max_seq_len], labels[k : k + max_seq_len]) for k in range(0, len(ids), max_seq_len)]
        else:
            pieces = [(ids[:max_seq_len], shifted_labels(ids[:max_seq_len], targets[:max_seq_len]))]
        pieces = [(a, b) for a, b in pieces if (b != IGNORE_INDEX).any()]
        if not pieces:
            skipped.append((row_id, f"no trained token within data.max_seq_len={max_seq_len}"))
        examples.extend(Example(a, b, row_id) for a, b in pieces)
    return examples, skipped


def same_examples(got: list[Example], want: list[Example]) -> None:
    assert [e.row_id for e in got] == [e.row_id for e in want]
    for a, b in zip(got, want):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels)


@pytest.mark.parametrize(("fmt", "overflow"), [("text", "split"), ("text", "truncate"), ("text", "drop"),
                                               ("prompt_completion", "truncate"), ("prompt_completion", "drop")])
def test_the_whole_array_cuts_equal_a_row_by_row_reference(tok, fmt, overflow):
    rows = random_rows(0, 200)
    row_ids = list(range(3, 403, 2))
    got, stats = tokenize_rows(rows, row_ids, tok, fmt, L, overflow)
    want, skipped = reference(rows, row_ids, tok, fmt, L, overflow)
    same_examples(got, want)
    assert stats.skipped == skipped and stats.num_examples == len(want)
    assert stats.num_rows == len({e.row_id for e in want})
    assert skipped or (fmt, overflow) in {("text", "split"), ("text", "truncate")}  # skipping is exercised


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def store_examples(directory) -> list[list[Example]]:
    store = TokenStore(directory)
    return [store.documents(i) for i in range(len(store))]


@pytest.mark.parametrize("packing", [False, True])
def test_the_store_is_the_same_however_the_rows_are_chunked(tmp_path, tok, monkeypatch, packing):
    monkeypatch.setattr(dataset_module, "PACK_WINDOW_TOKENS", 64)
    cfg = SFTDataConfig(path=write_rows(tmp_path / "d.jsonl", random_rows(1, 300)), format="text", max_seq_len=L,
                        packing=packing)
    stores = []
    for rows_per_chunk in (1000, 7, 1):
        monkeypatch.setattr(dataset_module, "CHUNK_ROWS", rows_per_chunk)
        stats = build_store(cfg, tok, tmp_path / f"store-{rows_per_chunk}")
        stores.append((stats, store_examples(tmp_path / f"store-{rows_per_chunk}")))
    for stats, samples in stores[1:]:
        assert stats == stores[0][0]
        assert len(samples) == len(stores[0][1])
        for got, want in zip(samples, stores[0][1]):
            same_examples(got, want)


def test_packing_plans_each_window_of_examples_as_pack_examples_does(tmp_path, tok, monkeypatch):
    """A window closes with the example that brings it to PACK_WINDOW_TOKENS; its examples are packed together,
    and windows follow each other. A corpus within one window packs exactly as pack_examples packs it all."""
    rows = random_rows(2, 300)
    examples, _ = tokenize_rows(rows, list(range(1, 301)), tok, "text", L, "split")
    path = write_rows(tmp_path / "d.jsonl", rows)
    for window in (40, 10**9):
        monkeypatch.setattr(dataset_module, "PACK_WINDOW_TOKENS", window)
        cfg = SFTDataConfig(path=path, format="text", max_seq_len=L, packing=True)
        stats = build_store(cfg, tok, tmp_path / f"packed-{window}")
        want, start, tokens = [], 0, 0
        for i, example in enumerate(examples):
            tokens += len(example.input_ids)
            if tokens >= window or i == len(examples) - 1:
                want.extend(pack_examples(examples[start : i + 1], L))
                start, tokens = i + 1, 0
        store = TokenStore(tmp_path / f"packed-{window}")
        assert stats.num_samples == len(store) == len(want)
        for got, sample in zip(store, want):
            assert got.row_ids == sample.row_ids
            for name in ("input_ids", "labels", "position_ids", "segment_ids"):
                assert np.array_equal(getattr(got, name), getattr(sample, name))
    assert len(want) < len(to_samples(examples))  # packing happened


def test_a_tokenizer_whose_backend_truncates_gives_the_tokenizers_own_ids():
    """tokenizer.json may switch truncation on; the tokenizer's own call switches it off, and so do the ids here."""
    tok = train_tokenizer([ALPHABET], "char", 64)
    tok.backend_tokenizer.enable_truncation(3)
    rows = random_rows(3, 20)
    got, _ = tokenize_rows(rows, list(range(20)), tok, "text", 64, "split")
    want, _ = reference(rows, list(range(20)), tok, "text", 64, "split")
    same_examples(got, want)
    assert max(len(e.input_ids) for e in got) > 5


PREPARE = """
import json, sys
from pathlib import Path
import numpy as np
import isotrain.data.dataset as dataset_module
from isotrain.config import SFTDataConfig
from isotrain.models.tokenizer import train_tokenizer

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

dataset_module.PACK_WINDOW_TOKENS = 1 << 16
directory, megabytes, packing = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "packed"
rng = np.random.default_rng(0)
letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
with open(directory / "corpus.jsonl", "w") as f:
    for _ in range(megabytes * 256):  # documents of 1 to 7 KiB, split into pieces of 1024 tokens
        f.write(json.dumps({"text": "".join(rng.choice(letters, int(rng.integers(1, 8)) * 1024))}) + "\\n")
tok = train_tokenizer(["".join(letters)], "char", 0)
cfg = SFTDataConfig(path=str(directory / "corpus.jsonl"), format="text", max_seq_len=1024, packing=packing,
                    prepare_chunk_mb=1 / 32)
before = status_kib("VmRSS")
stats = dataset_module.build_store(cfg, tok, directory / "store")
print(json.dumps({"tokens": stats.total_input_tokens, "peak_growth_kib": status_kib("VmHWM") - before}))
"""


@pytest.mark.slow
def test_preparing_a_corpus_takes_memory_for_its_buffers_not_its_size(tmp_path):
    """Preparing and packing 1 MB and 8 MB of text (about 1 M and 8 M tokens), with chunks of 32 K characters and
    packing windows of 64 K tokens (a corpus's gigabytes scaled down with its buffers): the peak memory grows by
    the buffers, then stays. The second corpus's peak exceeds the first's by less than 5 MiB (measured: 2.4 MiB,
    the index it adds and allocator slack), not by its 7 M more tokens (28 MB in the store's dtype).

    Both at the same number of tokenizer threads (2): the buffers are per thread (each thread's malloc arena keeps
    its largest share of a chunk, docs/data-preparation.md), and with 16 threads 1 MB of text is too few chunks to
    fill them all (measured, RAYON_NUM_THREADS=16: 40, 49, 53 and 54 MiB at 1, 4, 8 and 16 MB; 2 threads: 13, 14.5
    and 14.7 MiB at 1, 4 and 8 MB): the buffers reach their bound within a few MB, then stay. So a fixed thread
    count compares corpus sizes, which the promise is about, not thread counts."""
    peaks = {}
    env = {**subprocess_env(), "RAYON_NUM_THREADS": "2"}
    for megabytes in (1, 8):
        directory = tmp_path / str(megabytes)
        directory.mkdir()
        proc = subprocess.run([sys.executable, "-c", PREPARE, str(directory), str(megabytes), "packed"],
                              env=env, capture_output=True, text=True, check=True)
        peaks[megabytes] = json.loads(proc.stdout.splitlines()[-1])
    assert peaks[8]["tokens"] > 7.5 * peaks[1]["tokens"]
    assert peaks[8]["peak_growth_kib"] - peaks[1]["peak_growth_kib"] < 5 * 1024, peaks
