import json
import os
from pathlib import Path

import numpy as np
import pytest

import isotrain.data.cache as cache_module
import isotrain.data.dataset as dataset_module
import isotrain.data.store as store_module
from isotrain.config import SFTDataConfig
from isotrain.data import prepare_dataset
from isotrain.data.cache import cache_key, file_sha256, save_entry
from isotrain.data.store import write_samples
from isotrain.errors import DataError
from isotrain.models.tokenizer import add_special_tokens, train_tokenizer

ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(12) for b in range(3)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["0123456789+="], "char", vocab_size=0)


def write_jsonl(path: Path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "".join(line + "\n" for line in extra_lines))
    return str(path)


def same_samples(a, b):
    """`a`, `b`: datasets or lists of samples."""
    a, b = list(getattr(a, "samples", a)), list(getattr(b, "samples", b))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("input_ids", "labels", "position_ids", "segment_ids"):
            assert np.array_equal(getattr(x, name), getattr(y, name))
        assert x.row_ids == y.row_ids


def test_second_call_loads_from_cache(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = SFTDataConfig(path=path, format="prompt_completion", max_seq_len=16, packing=True)
    first = prepare_dataset(cfg, tok, log=lambda *_: None)
    assert Path(first.cache_path).parent.parent == tmp_path / "cache"  # $ISOTRAIN_CACHE, set by conftest
    monkeypatch.setattr(dataset_module, "tokenize_chunk", lambda *a, **k: pytest.fail("tokenized again"))
    lines = []
    second = prepare_dataset(cfg, tok, log=lines.append)
    same_samples(first, second)
    assert second.stats == first.stats
    assert any(line.startswith("loaded tokenized data from cache") for line in lines)


def test_cache_dir_option_wins(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = SFTDataConfig(path=path, format="prompt_completion", cache_dir=str(tmp_path / "mine"))
    dataset = prepare_dataset(cfg, tok, log=lambda *_: None)
    assert Path(dataset.cache_path).parent == tmp_path / "mine" / "tokenized"


def test_key_changes_with_options_data_and_tokenizer(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    options = {"format": "prompt_completion", "max_seq_len": 16, "packing": False, "add_special_tokens": []}
    base = cache_key(path, tok, options)
    assert cache_key(path, tok, dict(options)) == base
    assert cache_key(path, tok, {**options, "max_seq_len": 17}) != base
    assert cache_key(path, tok, {**options, "packing": True}) != base
    other_tok = train_tokenizer(["0123456789+=x"], "char", vocab_size=0)
    assert cache_key(path, other_tok, options) != base
    write_jsonl(tmp_path / "d.jsonl", ROWS[:-1])
    assert cache_key(path, tok, options) != base


def test_changed_data_file_is_not_served_from_the_old_entry(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    cfg = SFTDataConfig(path=write_jsonl(path, ROWS), format="prompt_completion")
    before = prepare_dataset(cfg, tok, log=lambda *_: None)
    write_jsonl(path, ROWS[:10])
    after = prepare_dataset(cfg, tok, log=lambda *_: None)
    assert len(before) == len(ROWS) and len(after) == 10
    assert before.cache_path != after.cache_path


def test_saved_dataset_directory_is_hashed_by_its_files(tmp_path, tok):
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(directory))
    options = {"format": "prompt_completion"}
    base = cache_key(str(directory), tok, options)
    datasets.Dataset.from_list(ROWS[:5]).save_to_disk(str(tmp_path / "ds2"))
    assert cache_key(str(tmp_path / "ds2"), tok, options) != base


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "drop_manifest", "garbage_manifest"])
def test_corrupt_cache_entry_is_rebuilt(tmp_path, tok, damage):
    cfg = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", ROWS), format="prompt_completion", packing=True)
    dataset = prepare_dataset(cfg, tok, log=lambda *_: None)
    first = list(dataset.samples)  # read now: the store maps the very files damaged below
    entry = Path(dataset.cache_path)
    target = entry / "input_ids.bin"
    data = target.read_bytes()
    if damage == "flip_byte":
        target.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "drop_manifest":
        (entry / "manifest.json").unlink()
    else:
        (entry / "manifest.json").write_text("{not json")
    lines = []
    second = prepare_dataset(cfg, tok, log=lines.append)
    same_samples(first, second)
    assert any("is unreadable" in line and "rebuilding it" in line for line in lines)
    lines.clear()
    prepare_dataset(cfg, tok, log=lines.append)  # the rebuilt entry is good again
    assert any(line.startswith("loaded tokenized data from cache") for line in lines)


def test_concurrent_writers_leave_one_whole_entry(tmp_path, tok):
    cfg = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", ROWS), format="prompt_completion")
    dataset = prepare_dataset(cfg, tok, log=lambda *_: None)
    entry = Path(dataset.cache_path)
    # A second rank finishing later finds the entry in place and keeps it.
    save_entry(entry, lambda directory: write_samples(directory, dataset.samples, np.dtype(np.uint16)) or
               {"num_rows_read": -1})
    assert json.loads((entry / "stats.json").read_text())["num_rows_read"] == len(ROWS)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary directories left


def test_skipped_rows_are_counted_and_logged_with_line_numbers(tmp_path, tok):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:3], extra_lines=['{"prompt": "1+1="}', "{oops"])
    lines = []
    dataset = prepare_dataset(SFTDataConfig(path=path, format="prompt_completion"), tok, log=lines.append)
    assert dataset.stats.num_rows_read == 5 and dataset.stats.num_rows_skipped == 2
    assert dataset.stats.skipped[0] == (4, "missing 'completion'")
    assert lines[0].startswith("skipped 2 of 5 rows in data.jsonl: line 4: missing 'completion'; line 5: invalid JSON")
    lines.clear()
    prepare_dataset(SFTDataConfig(path=path, format="prompt_completion"), tok, log=lines.append)
    assert any(line.startswith("skipped 2 of 5 rows in data.jsonl: line 4") for line in lines)  # also from cache


def test_missing_file_is_a_clear_error(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        prepare_dataset(SFTDataConfig(path=str(tmp_path / "no.jsonl")), tok, log=lambda *_: None)


def test_added_special_tokens_change_the_cache_entry(tmp_path):
    """model.add_special_tokens grows the tokenizer; its fingerprint, and so the cache entry, follow."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "completion": "3<tool>"}])
    cfg = SFTDataConfig(path=path, format="prompt_completion", cache_dir=str(tmp_path / "cache"))
    plain = train_tokenizer(["0123456789+="], "char", vocab_size=0)
    extended = train_tokenizer(["0123456789+="], "char", vocab_size=0)
    add_special_tokens(extended, ["<tool>"])
    a = prepare_dataset(cfg, plain, log=lambda *_: None)
    b = prepare_dataset(cfg, extended, log=lambda *_: None)
    assert a.cache_path != b.cache_path
    tool = extended.convert_tokens_to_ids("<tool>")
    assert tool in b[0].input_ids.tolist() and tool not in a[0].input_ids.tolist()


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("fmt", ["text", "prompt_completion"])
def test_token_totals_equal_counts_computed_from_rows(tmp_path, tok, fmt, packing):
    rng = np.random.default_rng(0)
    rows = [
        {"text": "".join(rng.choice(list("0123456789+="), size=n)), "prompt": "1+", "completion": "2" * n}
        for n in rng.integers(1, 20, size=50)
    ]
    cfg = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), format=fmt, max_seq_len=32, packing=packing)
    stats = prepare_dataset(cfg, tok, log=lambda *_: None).stats
    # Per row: bos + tokens + eos; every token after bos is trained (text), or only completion + eos.
    if fmt == "text":
        expected_trained = sum(len(row["text"]) + 1 for row in rows)
        expected_input = sum(len(row["text"]) + 2 for row in rows)
    else:
        expected_trained = sum(len(row["completion"]) + 1 for row in rows)
        expected_input = sum(len(row["prompt"]) + len(row["completion"]) + 2 for row in rows)
    assert stats.total_trained_tokens == expected_trained
    assert stats.total_input_tokens == expected_input
    assert stats.num_documents == 50 and stats.num_truncated == 0 and stats.num_rows_skipped == 0
    assert (stats.num_samples < 50) == packing


def test_a_data_files_sha256_is_remembered_while_its_path_size_mtime_and_inode_stay(tmp_path, monkeypatch):
    """A warm start reads no byte of the corpus: the file's sha256 comes from the memo while its stat is unchanged.
    A file written less than RACY_SECONDS ago is hashed every time (a same-size rewrite could keep its mtime)."""
    path, memo = tmp_path / "d.jsonl", tmp_path / "fingerprints"
    write_jsonl(path, ROWS)
    hashed = []
    real = cache_module.sha256_file
    monkeypatch.setattr(cache_module, "sha256_file", lambda p: hashed.append(p) or real(p))
    fresh = file_sha256(path, memo)
    assert file_sha256(path, memo) == fresh and len(hashed) == 2 and not memo.exists()  # too recent to remember
    old = path.stat().st_mtime_ns - 10 * 10**9
    os.utime(path, ns=(old, old))
    assert [file_sha256(path, memo) for _ in range(3)] == [fresh] * 3 and len(hashed) == 3
    write_jsonl(path, ROWS[::-1])  # same size, new content and mtime
    os.utime(path, ns=(old + 1, old + 1))
    assert file_sha256(path, memo) == real(path) != fresh and len(hashed) == 4


def test_damage_found_while_reading_a_large_store_names_the_entry_removes_it_and_the_next_start_rebuilds(
        tmp_path, tok, monkeypatch):
    monkeypatch.setattr(store_module, "CHECK_BLOCK_BYTES", 64)
    cfg = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", ROWS), format="prompt_completion", max_seq_len=16,
                        packing=True)
    first = list(prepare_dataset(cfg, tok, log=lambda *_: None).samples)
    monkeypatch.setattr(store_module, "EAGER_CHECK_BYTES", 0)
    entry = Path(prepare_dataset(cfg, tok, log=lambda *_: None).cache_path)
    data = bytearray((entry / "input_ids.bin").read_bytes())
    data[-3] ^= 0xFF
    (entry / "input_ids.bin").write_bytes(bytes(data))
    lines = []
    damaged = prepare_dataset(cfg, tok, log=lines.append)  # opens without reading the tokens
    assert any(line.startswith("loaded tokenized data from cache") for line in lines)
    damaged[0]
    with pytest.raises(DataError) as caught:
        damaged[len(damaged) - 1]
    assert str(caught.value).startswith(f"the tokenized-data cache entry {entry} is damaged (block ")
    assert str(caught.value).endswith("it was removed: run the same command again to rebuild it and resume from the "
                                      "last checkpoint")
    assert not entry.exists()
    same_samples(first, prepare_dataset(cfg, tok, log=lambda *_: None))
