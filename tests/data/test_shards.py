"""A source that is a glob or a directory of shards: sorted shards, rows numbered per shard, .jsonl.gz read
through gzip, one sentence for a glob without match, a non-gzip .gz, shards of another schema or kind; the cache
key covers every shard by name and content."""

import gzip
import json
from pathlib import Path

import pytest

from isotrain.config import SFTDataConfig
from isotrain.data import prepare_dataset
from isotrain.data.sources import SHARD_BITS, read_rows, resolve_source, row_label
from isotrain.errors import DataError
from isotrain.models.tokenizer import train_tokenizer


def lines(rows, bad=()):
    return "".join(json.dumps(row) + "\n" for row in rows) + "".join(line + "\n" for line in bad)


def text_rows(first: int, count: int) -> list[dict]:
    return [{"text": f"row {i}"} for i in range(first, first + count)]


@pytest.fixture
def shard_dir(tmp_path):
    """corpus/: b.jsonl (rows 3-4 and a bad line), a.jsonl.gz (rows 0-2), sub/c.jsonl (row 5), a README, a hidden file."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.jsonl").write_text(lines(text_rows(3, 2), bad=["{not json"]))
    with gzip.open(root / "a.jsonl.gz", "wt") as handle:
        handle.write(lines(text_rows(0, 3)))
    (root / "sub" / "c.jsonl").write_text(lines(text_rows(5, 1)))
    (root / "README.md").write_text("not data")
    (root / ".hidden.jsonl").write_text(lines(text_rows(99, 1)))
    return root


def test_a_directory_of_shards_reads_every_shard_in_name_order_with_shard_and_line_in_row_ids(shard_dir):
    result = read_rows(str(shard_dir), "text")
    assert [row["text"] for row in result.rows] == [f"row {i}" for i in range(6)]
    assert result.shards == ("a.jsonl.gz", "b.jsonl", "sub/c.jsonl")
    assert result.row_ids == [1, 2, 3, (1 << SHARD_BITS) | 1, (1 << SHARD_BITS) | 2, (2 << SHARD_BITS) | 1]
    assert [result.label(i) for i, _ in result.skipped] == ["b.jsonl line 3"]
    assert row_label(7, "line") == "line 7"


def test_a_glob_is_sorted_and_names_shards_relative_to_its_fixed_part(shard_dir):
    result = read_rows(str(shard_dir / "*.jsonl*"), "text")
    assert result.shards == ("a.jsonl.gz", "b.jsonl")
    assert len(result.rows) == 5
    recursive = resolve_source(str(shard_dir / "**" / "*.jsonl"))
    assert recursive.names == ("b.jsonl", "sub/c.jsonl")


def test_bad_sources_are_one_sentence_each(tmp_path, shard_dir):
    with pytest.raises(DataError, match=r"^data.path '.*/nothing-\*.jsonl' matches no file; check the pattern"):
        read_rows(str(tmp_path / "nothing-*.jsonl"), "text")
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text(lines(text_rows(0, 2)))
    with pytest.raises(DataError, match=r"is not gzip data although its name ends in .gz; compress it with gzip or "
                                        r"rename it to .jsonl$"):
        read_rows(str(fake), "text")
    (shard_dir / "d.jsonl").write_text(lines([{"content": "renamed field"}] * 3))
    with pytest.raises(DataError) as err:
        read_rows(str(shard_dir), "text")
    assert str(err.value) == (
        "data.path shard 'd.jsonl' has rows but not one valid row (first: line 1: missing 'text'), so its schema "
        f"differs from the other shards of {str(shard_dir)!r}; fix or remove it")
    (shard_dir / "d.jsonl").unlink()
    (shard_dir / "e.json").write_text(json.dumps(text_rows(0, 1)))
    with pytest.raises(DataError, match="holds shards of several kinds \\(JSON and JSON lines\\); use one kind"):
        read_rows(str(shard_dir), "text")


def test_parquet_shards_with_other_columns_are_refused_by_name(tmp_path):
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "pq").mkdir()
    pyarrow.parquet.write_table(pyarrow.table({"text": ["a", "b"]}), tmp_path / "pq" / "0.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"text": ["c"]}), tmp_path / "pq" / "1.parquet")
    assert [row["text"] for row in read_rows(str(tmp_path / "pq"), "text").rows] == ["a", "b", "c"]
    pyarrow.parquet.write_table(pyarrow.table({"body": ["d"]}), tmp_path / "pq" / "2.parquet")
    with pytest.raises(DataError, match=r"^data.path shard '2.parquet' has columns \(body: string\) but '0.parquet' "
                                        r"has \(text: string\); write every shard of .* with the same columns$"):
        read_rows(str(tmp_path / "pq"), "text")


def test_the_cache_key_covers_every_shard_and_the_expansion(tmp_path, shard_dir):
    tok = train_tokenizer(["row 0123456789"], "char", vocab_size=0)
    cfg = SFTDataConfig(path=str(shard_dir), format="text", max_seq_len=16, cache_dir=str(tmp_path / "cache"))
    logs = []
    first = prepare_dataset(cfg, tok, log=logs.append)
    assert first.stats.shards == ["a.jsonl.gz", "b.jsonl", "sub/c.jsonl"] and len(first) == 6
    assert any("skipped 1 of 7 rows in corpus (3 shards): b.jsonl line 3: invalid JSON" in line for line in logs)
    assert prepare_dataset(cfg, tok, log=lambda *_: None).cache_path == first.cache_path
    (shard_dir / "sub" / "d.jsonl").write_text(lines(text_rows(6, 1)))  # one more shard: a new entry
    grown = prepare_dataset(cfg, tok, log=lambda *_: None)
    assert grown.cache_path != first.cache_path and len(grown) == 7
    (shard_dir / "sub" / "d.jsonl").rename(shard_dir / "sub" / "e.jsonl")  # same bytes, another name
    renamed = prepare_dataset(cfg, tok, log=lambda *_: None)
    assert renamed.cache_path not in (first.cache_path, grown.cache_path)
    assert Path(renamed.cache_path).parent == Path(first.cache_path).parent


def test_a_sources_fingerprint_is_a_files_sha256_or_covers_every_shard(tmp_path, shard_dir):
    from isotrain.data.cache import source_fingerprint
    from isotrain.disk import sha256_file

    single = shard_dir / "b.jsonl"
    assert source_fingerprint(str(single)) == sha256_file(single)  # as RL checkpoints recorded it before
    before = source_fingerprint(str(shard_dir))
    assert source_fingerprint(str(shard_dir / "**" / "*.jsonl*")) == before  # the same shards, named alike
    (shard_dir / "sub" / "c.jsonl").write_text(lines(text_rows(50, 1)))
    assert source_fingerprint(str(shard_dir)) != before
