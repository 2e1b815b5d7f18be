"""{"query", "positive", "negatives": [...]} rows -> tokenized EmbedSamples.

Rows come from the same sources as SFT data (.jsonl, .json, .parquet, a saved dataset). A malformed
row (bad JSON, a missing or empty field, fewer than `embed.hard_negatives` negatives) is skipped and
kept with its line number and reason, for the caller to report: none is dropped silently.
"""

from __future__ import annotations

import hashlib

from isotrain.data.sources import RowsResult, sort_rows
from isotrain.embed.batch import EmbedSample
from isotrain.errors import DataError


def text_id(text: str) -> int:
    """A 63-bit id of a text: equal texts, equal ids (collisions have probability ~n²/2⁶⁴)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") & (2**63 - 1)


def row_problem(row: object, num_negatives: int) -> str | None:
    """Why `row` is not a usable contrastive row with `num_negatives` hard negatives, or None."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, not an object"
    for key in ("query", "positive"):
        value = row.get(key)
        if value is None:
            return f"missing {key!r}"
        if not isinstance(value, str):
            return f"{key!r} must be a string, not {type(value).__name__}"
        if not value.strip():
            return f"{key!r} is empty"
    negatives = row.get("negatives", [])
    if negatives is None:
        negatives = []
    if not isinstance(negatives, list) or not all(isinstance(n, str) and n.strip() for n in negatives):
        return "'negatives' must be a list of non-empty strings"
    if len(negatives) < num_negatives:
        return f"{len(negatives)} negatives, fewer than embed.hard_negatives={num_negatives}"
    return None


def read_pairs(path: str, num_negatives: int, field: str = "data.path") -> RowsResult:
    """Every usable row of `path`, plus the skipped ones with their line (or row) numbers and reasons."""
    result = sort_rows(path, field, lambda row: row_problem(row, num_negatives))
    if not result.rows:
        first = f" (first: {result.unit} {result.skipped[0][0]}: {result.skipped[0][1]})" if result.skipped else ""
        raise DataError(f"{field} {path!r} has no usable {{query, positive, negatives}} rows{first}; "
                        "fix the rows or lower embed.hard_negatives")
    return result


def skipped_report(result: RowsResult, limit: int = 5) -> str | None:
    """One line naming how many rows were skipped and the first few, or None when none were."""
    if not result.skipped:
        return None
    shown = "; ".join(f"{result.unit} {i}: {reason}" for i, reason in result.skipped[:limit])
    more = f"; and {len(result.skipped) - limit} more" if len(result.skipped) > limit else ""
    return f"skipped {len(result.skipped)} of {result.num_rows_read} rows: {shown}{more}"


def tokenize_rows(rows: list[dict], tokenizer, max_len: int, num_negatives: int, query_prefix: str = "") -> list[EmbedSample]:
    """Token ids (special tokens included, truncated to `max_len`) and text ids of each row's texts."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, truncation=True, max_length=max_len)["input_ids"]

    samples = []
    for row in rows:
        query = query_prefix + row["query"]
        negatives = (row.get("negatives") or [])[:num_negatives]
        samples.append(EmbedSample(ids(query), ids(row["positive"]), [ids(n) for n in negatives],
                                   text_id(query), text_id(row["positive"]), [text_id(n) for n in negatives]))
    return samples
