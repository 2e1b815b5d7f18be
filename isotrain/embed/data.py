"""{"query", "positive", "negatives": [...]} rows -> tokenized EmbedSamples.

Rows come from the same sources as SFT data (.jsonl, .json, .parquet, a saved dataset). A malformed
row (bad JSON, a missing or empty field, fewer than the hard negatives used) is skipped and kept with its
line number and reason, for the caller to report: none is dropped silently.

How many hard negatives each query uses follows the data unless set (`resolve_hard_negatives`): a user's
negatives are trained with, not ignored without a word.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

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
        first = f" (first: {result.label(result.skipped[0][0])}: {result.skipped[0][1]})" if result.skipped else ""
        raise DataError(f"{field} {path!r} has no usable {{query, positive, negatives}} rows{first}; "
                        "fix the rows or lower embed.hard_negatives")
    return result


def _num_negatives(row: dict) -> int:
    return len(row.get("negatives") or [])


def resolve_hard_negatives(rows: list[dict], configured: int | None) -> int:
    """Hard negatives per query: `configured` when set; else the fewest that a row carrying any has (so no such
    row is skipped, and every query has as many: the loss's layout needs the same count for all), 0 when no row
    carries any. `rows` are usable rows (`read_pairs(path, 0)`)."""
    if configured is not None:
        return configured
    counts = [_num_negatives(row) for row in rows if _num_negatives(row)]
    return min(counts, default=0)


def hard_negatives_note(rows: list[dict], configured: int | None, num_negatives: int) -> str:
    """The start-up line: how many hard negatives per query are used, and why."""
    counts = [_num_negatives(row) for row in rows if _num_negatives(row)]
    num_without = len(rows) - len(counts)
    carried = "no row carries any" if not counts else (
        f"{len(counts)} of {len(rows)} rows carry " + (f"{counts[0]}" if min(counts) == max(counts)
                                                       else f"{min(counts)} to {max(counts)}"))
    if configured is not None:
        return f"hard negatives: {num_negatives} per query (embed.hard_negatives={configured}; {carried})"
    if not counts:
        return "hard negatives: 0 per query (no row carries `negatives`; in-batch negatives only)"
    note = f"hard negatives: {num_negatives} per query, the fewest a row carries ({carried})"
    if num_without:
        rows_are = f"{num_without} rows without negatives are" if num_without > 1 else "1 row without negatives is"
        note += f"; {rows_are} skipped: set embed.hard_negatives=0 to keep them and train without hard negatives"
    return note


def keep_rows_with_negatives(result: RowsResult, num_negatives: int) -> RowsResult:
    """`result` with the rows that have fewer than `num_negatives` negatives moved to its skipped rows (with
    the reason `read_pairs` gives), in row order."""
    kept = [(i, row) for i, row in zip(result.row_ids, result.rows) if _num_negatives(row) >= num_negatives]
    short = [(i, row_problem(row, num_negatives)) for i, row in zip(result.row_ids, result.rows)
             if _num_negatives(row) < num_negatives]
    return replace(result, rows=[row for _, row in kept], row_ids=[i for i, _ in kept],
                   skipped=sorted(result.skipped + short))


def read_training_pairs(path: str, configured: int | None, field: str = "data.path") -> tuple[RowsResult, int, str]:
    """The usable rows of `path` with the hard negatives per query resolved from them (`resolve_hard_negatives`),
    and the line that says how many and why. Rows with fewer are skipped and reported, as `read_pairs` does."""
    [kept], num_negatives, note = read_training_sources([(path, field)], configured)
    return kept, num_negatives, note


def read_training_sources(paths: list[tuple[str, str]], configured: int | None) -> tuple[list[RowsResult], int, str]:
    """`read_training_pairs` of several sources, given as (path, config field): one count of hard negatives for
    all of them (every query of a global batch needs the same count), resolved from all their rows."""
    results = [read_pairs(path, 0, field) for path, field in paths]
    rows = [row for result in results for row in result.rows]
    num_negatives = resolve_hard_negatives(rows, configured)
    note = hard_negatives_note(rows, configured, num_negatives)
    kept = [keep_rows_with_negatives(result, num_negatives) for result in results]
    for (path, field), result in zip(paths, kept):
        if not result.rows:
            first = result.skipped[0]
            raise DataError(f"{field} {path!r} has no usable {{query, positive, negatives}} rows (first: "
                            f"{result.label(first[0])}: {first[1]}); fix the rows or lower embed.hard_negatives")
    return kept, num_negatives, note


def sample_tokens(samples: list[EmbedSample]) -> np.ndarray:
    """Each sample's tokens: its query, positive and negatives together, every one of them trained."""
    return np.array([len(sample.query) + len(sample.positive) + sum(map(len, sample.negatives))
                     for sample in samples], dtype=np.int64)


def skipped_report(result: RowsResult, limit: int = 5) -> str | None:
    """One line naming how many rows were skipped and the first few, or None when none were."""
    if not result.skipped:
        return None
    shown = "; ".join(f"{result.label(i)}: {reason}" for i, reason in result.skipped[:limit])
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
