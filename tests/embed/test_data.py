"""Contrastive rows: malformed rows skipped with their line numbers and reasons, never silently."""

import json

import pytest

from isotrain.embed.data import read_pairs, skipped_report, text_id
from isotrain.errors import DataError


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_rows_are_counted_with_line_numbers(tmp_path):
    good = {"query": "q", "positive": "p", "negatives": ["a", "b"]}
    path = write(tmp_path / "d.jsonl", [
        json.dumps(good),
        json.dumps({"positive": "p"}),  # 2: no query
        json.dumps({"query": "q", "positive": "  "}),  # 3: empty positive
        "{not json",  # 4
        json.dumps({"query": "q", "positive": "p", "negatives": ["a"]}),  # 5: one negative, two wanted
        json.dumps({"query": "q", "positive": "p", "negatives": [3]}),  # 6
        json.dumps({**good, "negatives": ["x", "y", "z"]}),  # more negatives than used: kept
    ])
    result = read_pairs(path, num_negatives=2)
    assert result.row_ids == [1, 7]
    assert [i for i, _ in result.skipped] == [2, 3, 4, 5, 6]
    assert result.skipped[0][1] == "missing 'query'"
    assert result.skipped[1][1] == "'positive' is empty"
    assert result.skipped[3][1] == "1 negatives, fewer than embed.hard_negatives=2"
    assert skipped_report(result).startswith("skipped 5 of 7 rows: line 2: missing 'query'; line 3:")
    assert read_pairs(path, num_negatives=0).row_ids == [1, 5, 7]  # without hard negatives, row 5 is usable


def test_no_usable_rows_is_one_sentence(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"query": "q"})])
    with pytest.raises(DataError, match=r"has no usable \{query, positive, negatives\} rows \(first: line 1: "
                                        r"missing 'positive'\)"):
        read_pairs(path, 0)


def test_text_ids_are_equal_for_equal_texts():
    assert text_id("same") == text_id("same") != text_id("other")
