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


def test_hard_negatives_follow_the_data_unless_set():
    """Unset: the fewest a row carrying negatives has (no such row skipped); none carried: 0; set: as set."""
    from isotrain.embed.data import resolve_hard_negatives

    rows = [{"query": "q", "positive": "p", "negatives": ["a", "b", "c"]},
            {"query": "q", "positive": "p", "negatives": ["a", "b"]},
            {"query": "q", "positive": "p"}, {"query": "q", "positive": "p", "negatives": []}]
    assert resolve_hard_negatives(rows, None) == 2
    assert resolve_hard_negatives(rows[2:], None) == 0
    assert resolve_hard_negatives([], None) == 0
    assert resolve_hard_negatives(rows, 0) == 0 and resolve_hard_negatives(rows, 3) == 3


def test_training_pairs_say_how_many_negatives_and_why(tmp_path):
    from isotrain.embed.data import read_training_pairs

    with_negatives = lambda n: json.dumps({"query": "q", "positive": "p", "negatives": [f"n{j}" for j in range(n)]})  # noqa: E731
    carried = write(tmp_path / "carried.jsonl", [with_negatives(3), with_negatives(2), "{bad"])
    result, num, note = read_training_pairs(carried, None)
    assert (result.row_ids, num) == ([1, 2], 2) and result.skipped == [(3, result.skipped[0][1])]
    assert note == "hard negatives: 2 per query, the fewest a row carries (2 of 2 rows carry 2 to 3)"

    none = write(tmp_path / "none.jsonl", [json.dumps({"query": "q", "positive": "p"})] * 2)
    result, num, note = read_training_pairs(none, None)
    assert (result.row_ids, num) == ([1, 2], 0)
    assert note == "hard negatives: 0 per query (no row carries `negatives`; in-batch negatives only)"

    mixed = write(tmp_path / "mixed.jsonl", [with_negatives(2), json.dumps({"query": "q", "positive": "p"}),
                                             with_negatives(2)])
    result, num, note = read_training_pairs(mixed, None)
    assert (result.row_ids, num) == ([1, 3], 2)
    assert result.skipped == [(2, "0 negatives, fewer than embed.hard_negatives=2")]  # counted and reported
    assert note == ("hard negatives: 2 per query, the fewest a row carries (2 of 3 rows carry 2); 1 row without "
                    "negatives is skipped: set embed.hard_negatives=0 to keep them and train without hard negatives")

    # Set explicitly: today's handling, the first N of each row, rows with fewer skipped (as read_pairs does).
    result, num, note = read_training_pairs(carried, 3)
    assert (result.row_ids, num) == ([1], 3) == (read_pairs(carried, 3).row_ids, 3)
    assert result.skipped == read_pairs(carried, 3).skipped
    assert note == "hard negatives: 3 per query (embed.hard_negatives=3; 2 of 2 rows carry 2 to 3)"
    assert read_training_pairs(mixed, 0)[0].row_ids == [1, 2, 3]
    with pytest.raises(DataError, match=r"has no usable .* \(first: line 1: 2 negatives, fewer than "
                                        r"embed.hard_negatives=5\); fix the rows or lower embed.hard_negatives"):
        read_training_pairs(mixed, 5)
