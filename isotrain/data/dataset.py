"""The data entry point: rows on disk -> tokenized, optionally packed samples, cached.

    read_rows -> tokenize_rows -> pack_examples | to_samples -> cache entry (a token store) -> Dataset

The dataset's own totals (`DataStats.total_input_tokens`, `total_trained_tokens`) are what one
epoch of training must count exactly (invariant 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from isotrain.config import SFTDataConfig
from isotrain.data.cache import CacheUnreadable, cache_key, cache_root, discard_entry, load_entry, save_entry
from isotrain.data.packing import Sample, pack_examples, to_samples
from isotrain.data.sources import check_source, read_rows
from isotrain.data.store import TokenStore
from isotrain.data.tokenize import IGNORE_INDEX, tokenize_rows
from isotrain.errors import DataError

MAX_REPORTED_SKIPS = 20  # skipped rows kept in the stats; all are counted
MAX_LOGGED_SKIPS = 5  # skipped rows named in the log line


@dataclass
class DataStats:
    num_rows_read: int  # rows in the source, valid or not
    num_rows_skipped: int  # malformed rows plus rows that could not be tokenized
    skipped: list[tuple[int, str]]  # the first MAX_REPORTED_SKIPS (line or row number, reason)
    num_truncated: int  # rows cut to data.max_seq_len tokens
    num_samples: int
    total_input_tokens: int  # Σ len(input_ids) over samples
    total_trained_tokens: int  # Σ (labels != -100) over samples
    num_documents: int = 0  # kept rows; > num_samples when packing
    row_unit: str = "line"  # "line" (.jsonl) or "row": how skipped rows are numbered
    num_split: int = 0  # rows split into pieces of at most data.max_seq_len tokens (data.overflow=split)
    num_pieces: int = 0  # the examples the kept rows became: num_documents plus the extra pieces of split rows
    corpus_tokens: int = 0  # Σ tokens of the rows that tokenized, before any cut
    corpus_trained_tokens: int = 0  # Σ targets of those rows before any cut: what one epoch could train

    @classmethod
    def from_json(cls, mapping: dict) -> DataStats:
        stats = cls(**mapping)
        stats.skipped = [(int(row_id), str(reason)) for row_id, reason in stats.skipped]
        return stats


@dataclass
class Dataset:
    samples: Sequence[Sample]  # a TokenStore (memory-mapped) once prepared
    stats: DataStats
    cache_path: str | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[int(index)]


def data_options(data_cfg: SFTDataConfig) -> dict:
    """The data settings that change the samples, and so the cache key."""
    return {
        "format": data_cfg.format,
        "max_seq_len": data_cfg.max_seq_len,
        "packing": data_cfg.packing,
        "overflow": data_cfg.overflow_rule,
    }


def prepare_dataset(data_cfg: SFTDataConfig, tokenizer, *, log=print) -> Dataset:
    """Samples of `data_cfg.path` for `tokenizer`, from the cache when the same inputs were seen before.

    Tokens added with `model.add_special_tokens` are already in `tokenizer` (the trainer adds them,
    since it also resizes the embeddings); the cache key covers them through the tokenizer's fingerprint.
    """
    check_source(data_cfg.path)
    entry = cache_root(data_cfg.cache_dir) / "tokenized" / cache_key(data_cfg.path, tokenizer, data_options(data_cfg))
    try:
        cached = load_entry(entry)
    except CacheUnreadable as err:
        log(f"tokenized-data cache {entry} is unreadable ({err}); rebuilding it")
        discard_entry(entry)
        cached = None
    if cached is not None:
        samples, stats = cached[0], DataStats.from_json(cached[1])
        log(f"loaded tokenized data from cache {entry}")
    else:
        built, stats = build_samples(data_cfg, tokenizer)
        save_entry(entry, built, asdict(stats))
        del built  # the run reads the store's memory maps, like a run that finds the entry
        samples = TokenStore(entry)
    _log_stats(stats, data_cfg.path, log, data_cfg.max_seq_len, data_cfg.format)
    return Dataset(samples=samples, stats=stats, cache_path=str(entry))


def build_samples(data_cfg: SFTDataConfig, tokenizer) -> tuple[list[Sample], DataStats]:
    """Read, tokenize and (optionally) pack; no cache involved."""
    rows = read_rows(data_cfg.path, data_cfg.format)
    examples, token_stats = tokenize_rows(rows.rows, rows.row_ids, tokenizer, data_cfg.format, data_cfg.max_seq_len,
                                          data_cfg.overflow_rule)
    skipped = sorted(rows.skipped + token_stats.skipped)
    if not examples:
        first_id, first_reason = skipped[0]
        raise DataError(
            f"no row of data.path {data_cfg.path!r} could be tokenized ({rows.unit} {first_id}: {first_reason}); "
            "fix the rows, raise data.max_seq_len or use a tokenizer that fits data.format"
        )
    samples = pack_examples(examples, data_cfg.max_seq_len) if data_cfg.packing else to_samples(examples)
    stats = DataStats(
        num_rows_read=rows.num_rows_read,
        num_rows_skipped=len(skipped),
        skipped=skipped[:MAX_REPORTED_SKIPS],
        num_truncated=token_stats.num_truncated,
        num_samples=len(samples),
        total_input_tokens=int(sum(len(sample) for sample in samples)),
        total_trained_tokens=int(sum(np.count_nonzero(sample.labels != IGNORE_INDEX) for sample in samples)),
        num_documents=token_stats.num_rows,
        row_unit=rows.unit,
        num_split=token_stats.num_split,
        num_pieces=len(examples),
        corpus_tokens=token_stats.corpus_tokens,
        corpus_trained_tokens=token_stats.corpus_trained_tokens,
    )
    return samples, stats


def _log_stats(stats: DataStats, path: str, log, max_seq_len: int, fmt: str) -> None:
    name = Path(path).name
    if stats.num_rows_skipped:
        shown = "; ".join(f"{stats.row_unit} {row_id}: {reason}" for row_id, reason in stats.skipped[:MAX_LOGGED_SKIPS])
        more = "; …" if stats.num_rows_skipped > MAX_LOGGED_SKIPS else ""
        log(f"skipped {stats.num_rows_skipped} of {stats.num_rows_read} rows in {name}: {shown}{more}")
    log(f"data {name}: {stats.num_documents} rows -> {stats.num_samples} samples, {stats.total_input_tokens} tokens, "
        f"{_trained_share(stats)}{_overflow_note(stats, max_seq_len, fmt)}")


def _trained_share(stats: DataStats) -> str:
    """How many of the rows' targets one epoch trains (all of them unless rows were truncated)."""
    share = stats.total_trained_tokens / max(stats.corpus_trained_tokens, 1)
    return (f"{stats.total_trained_tokens} trained ({share:.1%} of the {stats.corpus_trained_tokens} targets in "
            "the rows)")


def _overflow_note(stats: DataStats, max_seq_len: int, fmt: str) -> str:
    notes = []
    if stats.num_split:
        notes.append(f"{stats.num_split} rows longer than data.max_seq_len={max_seq_len} split into pieces "
                     f"({stats.num_pieces} examples from {stats.num_documents} rows)")
    if stats.num_truncated:
        keep = " (data.overflow=split keeps every token)" if fmt == "text" else ""
        notes.append(f"{stats.num_truncated} rows truncated to data.max_seq_len={max_seq_len}{keep}")
    return "".join(f"; {note}" for note in notes)
