"""The data entry point: rows on disk -> tokenized, optionally packed samples, cached.

    checked_rows -> tokenize_chunk (a chunk at a time: one ahead in a thread, or in worker processes for chat;
                    data/workers.py)
        [-> windows of PACK_WINDOW_TOKENS -> pack_plan] -> StoreWriter -> cache entry (a token store) -> Dataset

The dataset's own totals (`DataStats.total_input_tokens`, `total_trained_tokens`) are what one
epoch of training must count exactly (invariant 2).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import ClassVar

import numpy as np

from isotrain.config import SFTDataConfig
from isotrain.data.cache import CacheUnreadable, cache_key, cache_root, discard_entry, load_entry, save_entry
from isotrain.data.packing import Sample, pack_plan
from isotrain.data.sources import FORMATS, Source, checked_rows, no_rows_message, resolve_source, row_label, row_problem
from isotrain.data.store import StoreMismatch, StoreWriter, TokenStore, token_dtype
from isotrain.data.tokenize import IGNORE_INDEX, Pieces, TokenizeStats, tokenize_chunk
from isotrain.data.workers import release_freed_memory, resolve_workers, tokenized_in_order
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
    shards: list[str] = field(default_factory=list)  # a glob's or directory's shard names: row ids name them

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
    epoch_table: ClassVar = None  # every epoch holds the same samples (a mixture's differ: data/mixture.py)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def epoch_samples(self) -> int:
        """The samples one epoch orders (the sampler leaves out its last len % G; a mixture's epoch is whole
        global batches, data/mixture.py)."""
        return len(self.samples)

    @property
    def fingerprint(self) -> str | None:
        """What a resume must match: the cache entry's name (a hash of everything that made the samples)."""
        return Path(self.cache_path).name if self.cache_path else None

    def __getitem__(self, index: int) -> Sample:
        try:
            return self.samples[int(index)]
        except StoreMismatch as err:
            self._damaged(err)

    def trained_counts(self) -> np.ndarray:
        """Every sample's trained tokens, remembered beside the cache entry (`<cache>/trained-counts/<entry>.npy`)
        so that only the first start reads the labels; a remembered array that does not match the entry's length
        and total is computed again."""
        entry = Path(self.cache_path)
        memo = entry.parent.parent / "trained-counts" / f"{entry.name}.npy"
        try:
            counts = np.load(memo, allow_pickle=False)
            if len(counts) == len(self) and int(counts.sum()) == self.stats.total_trained_tokens:
                return counts
        except (OSError, ValueError):
            pass
        try:
            counts = self.samples.trained_counts()
        except StoreMismatch as err:
            self._damaged(err)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}.npy")
        np.save(tmp, counts, allow_pickle=False)
        os.replace(tmp, memo)  # two ranks writing at once leave one whole file
        return counts

    def _damaged(self, err: StoreMismatch):
        # A large store checks its token blocks as they are read: damage found mid-run ends the run before
        # any damaged token is trained on, and the entry goes, so that the next start rebuilds it.
        if self.cache_path is None:
            raise err
        discard_entry(Path(self.cache_path))
        raise DataError(f"the tokenized-data cache entry {self.cache_path} is damaged ({err}); it was removed: "
                        "run the same command again to rebuild it and resume from the last checkpoint") from None


def data_options(data_cfg: SFTDataConfig) -> dict:
    """The data settings that change the samples, and so the cache key."""
    return {
        "format": data_cfg.format,
        "max_seq_len": data_cfg.max_seq_len,
        "packing": data_cfg.packing,
        "overflow": data_cfg.overflow_rule,
        "pack_window_tokens": PACK_WINDOW_TOKENS if data_cfg.packing else None,
    }


def prepare_dataset(data_cfg: SFTDataConfig, tokenizer, *, log=print, field: str = "data.path") -> Dataset:
    """Samples of `data_cfg.path` for `tokenizer`, from the cache when the same inputs were seen before;
    messages name the setting `field` (data.path, or data.sources[i].path for a source of a mixture).

    Tokens added with `model.add_special_tokens` are already in `tokenizer` (the trainer adds them,
    since it also resizes the embeddings); the cache key covers them through the tokenizer's fingerprint.
    """
    source = resolve_source(data_cfg.path, field)
    root = cache_root(data_cfg.cache_dir)
    entry = root / "tokenized" / cache_key(_key_source(source), tokenizer, data_options(data_cfg),
                                           root / "fingerprints")
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
        stats = DataStats.from_json(save_entry(entry, lambda directory: asdict(build_store(data_cfg, tokenizer,
                                                                                          directory, field))))
        samples = TokenStore(entry)
    _log_stats(stats, data_cfg.path, log, data_cfg.max_seq_len, data_cfg.format)
    return Dataset(samples=samples, stats=stats, cache_path=str(entry))


def _key_source(source: Source):
    """What the cache key hashes: the path of one file or saved dataset, or every shard by name (the glob's or
    directory's expansion) and content."""
    return list(zip(source.names, source.files)) if source.names else source.path


# Rows read and tokenized at a time: up to CHUNK_ROWS rows and data.prepare_chunk_mb of text (CHAT_CHUNK_ROWS for
# chat rows in worker processes, so that a few thousand conversations keep every worker busy). The chunking never
# changes the store. What preparing holds is a few chunks' tokenizer output, about 100 bytes per token, and the
# packing window; the store's index goes to disk as it grows. glibc gives each thread of the Rust tokenizer its own
# malloc arena, which would keep the largest share of a chunk that thread ever encoded: the memory freed is given
# back after every chunk (workers.release_freed_memory; docs/data-preparation.md).
CHUNK_ROWS, CHAT_CHUNK_ROWS = 4096, 256
# Packing plans over consecutive windows of examples: a window closes with the example that brings it to
# PACK_WINDOW_TOKENS tokens (so the windows depend on the examples alone, not on how rows were chunked). A window
# is held in the store's dtype (2 or 4 bytes per id and per label): memory stays bounded however large the corpus.
PACK_WINDOW_TOKENS = 1 << 22


def build_store(data_cfg: SFTDataConfig, tokenizer, directory: Path, field: str = "data.path") -> DataStats:
    """Read, tokenize and (optionally) pack the rows of data.path into a token store at `directory`, a chunk of
    rows at a time: the tokens go to disk as they come. A worker thread tokenizes the next chunk (the Rust
    tokenizer runs on every core, without the GIL), or for chat rows data.prepare_workers processes render and
    tokenize chunks, while this one reads rows and writes the last chunk's tokens (data/workers.py). Messages name
    the setting `field` that points at the rows."""
    fmt, max_seq_len = data_cfg.format, data_cfg.max_seq_len
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    source = resolve_source(data_cfg.path, field)
    rows, unit = checked_rows(data_cfg.path, field, lambda row: row_problem(row, fmt), source)
    # Some tokenizers hold ids at or past len(tokenizer) (gaps before added tokens): the largest id decides.
    dtype = token_dtype(max(len(tokenizer) - 1, *tokenizer.get_vocab().values()))
    writer = StoreWriter(directory, dtype)
    window = _PackWindow(writer, max_seq_len) if data_cfg.packing else None
    totals, tally = TokenizeStats(), _Skips()
    num_rows_read = num_valid = tokens = trained = 0

    def tokenize(chunk):
        valid = [(row_id, row) for row_id, row, reason in chunk if reason is None]
        return len(valid), tokenize_chunk([row for _, row in valid], [row_id for row_id, _ in valid], tokenizer,
                                          fmt, max_seq_len, data_cfg.overflow_rule)

    # Chat templates render in Python: worker processes, on chunks small enough to keep them all busy.
    processes = resolve_workers(data_cfg.prepare_workers) if fmt == "chat" else 1
    rows_per_chunk = min(CHUNK_ROWS, CHAT_CHUNK_ROWS) if processes > 1 else CHUNK_ROWS
    chunks = _chunks(rows, rows_per_chunk, int(data_cfg.prepare_chunk_mb * (1 << 20)))
    with closing(tokenized_in_order(tokenize, chunks, processes)) as results:  # a failure stops the workers now
        for chunk, (valid, (pieces, stats)) in results:
            num_rows_read += len(chunk)
            num_valid += valid
            tally.add(sorted([(row_id, reason) for row_id, _, reason in chunk if reason is not None] + stats.skipped))
            tokens += len(pieces.input_ids)
            trained += int(np.count_nonzero(pieces.labels != IGNORE_INDEX))
            if window is not None:
                window.add(pieces)
            else:
                writer.add_samples(pieces.input_ids, pieces.labels, pieces.lengths, pieces.row_ids)
            for name in ("num_examples", "num_rows", "num_truncated", "num_split", "corpus_tokens",
                         "corpus_trained_tokens"):
                setattr(totals, name, getattr(totals, name) + getattr(stats, name))
            del pieces
            release_freed_memory()  # the freed encodings, so that the peak does not climb with the corpus
    if window is not None:
        window.flush_all()
    writer.close()
    if not num_valid:
        first = f"{row_label(tally.first[0][0], unit, source.names)}: {tally.first[0][1]}" if tally.first else None
        raise DataError(no_rows_message(data_cfg.path, fmt, tally.count, first, field))
    if not totals.num_examples:
        first_id, first_reason = tally.first[0]
        raise DataError(
            f"no row of {field} {data_cfg.path!r} could be tokenized ({row_label(first_id, unit, source.names)}: "
            f"{first_reason}); "
            "fix the rows, raise data.max_seq_len or use a tokenizer that fits data.format"
        )
    return DataStats(
        num_rows_read=num_rows_read, num_rows_skipped=tally.count, skipped=tally.first,
        num_truncated=totals.num_truncated, num_samples=writer.num_samples, total_input_tokens=tokens,
        total_trained_tokens=trained, num_documents=totals.num_rows, row_unit=unit, num_split=totals.num_split,
        num_pieces=totals.num_examples, corpus_tokens=totals.corpus_tokens,
        corpus_trained_tokens=totals.corpus_trained_tokens, shards=list(source.names))


def _chunks(rows, max_rows: int, max_chars: int):
    """Lists of consecutive (row id, row, reason) of at most `max_rows` rows and about `max_chars` characters."""
    chunk, chars = [], 0
    for item in rows:
        chunk.append(item)
        chars += _characters(item[1])
        if len(chunk) >= max_rows or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _characters(row) -> int:
    """The characters of a row's text fields (text, prompt and completion, or the messages' contents)."""
    if row is None:
        return 0
    messages = row.get("messages") or []
    return sum(len(row.get(key) or "") for key in ("text", "prompt", "completion")) + \
        sum(len(message["content"]) for message in messages)


class _Skips:
    """The skipped rows: all counted, the first MAX_REPORTED_SKIPS kept (added in row order)."""

    def __init__(self):
        self.count, self.first = 0, []

    def add(self, skipped: list[tuple[int, str]]) -> None:
        self.count += len(skipped)
        self.first.extend(skipped[: MAX_REPORTED_SKIPS - len(self.first)])


class _PackWindow:
    """Examples waiting to be packed (PACK_WINDOW_TOKENS above), in the store's dtype; full windows are packed
    by `pack_plan` and written as they close."""

    def __init__(self, writer: StoreWriter, max_seq_len: int):
        self.writer, self.max_seq_len = writer, max_seq_len
        self.parts: list[Pieces] = []
        self.tokens = 0

    def add(self, pieces: Pieces) -> None:
        self.parts.append(Pieces(*self.writer.encode(pieces.input_ids, pieces.labels), pieces.lengths, pieces.row_ids))
        self.tokens += len(pieces.input_ids)
        while self.tokens >= PACK_WINDOW_TOKENS:
            whole = self._merged()
            ends = np.cumsum(whole.lengths)
            last = int(np.searchsorted(ends, PACK_WINDOW_TOKENS))  # the example that reaches the window's size
            cut = int(ends[last])
            self._write(Pieces(whole.input_ids[:cut], whole.labels[:cut], whole.lengths[: last + 1],
                               whole.row_ids[: last + 1]))
            rest = Pieces(whole.input_ids[cut:], whole.labels[cut:], whole.lengths[last + 1 :],
                          whole.row_ids[last + 1 :])
            self.parts, self.tokens = [rest], len(rest.input_ids)

    def flush_all(self) -> None:
        if self.tokens:
            self._write(self._merged())
        self.parts, self.tokens = [], 0

    def _merged(self) -> Pieces:
        return Pieces(*(np.concatenate([getattr(part, name) for part in self.parts])
                        for name in ("input_ids", "labels", "lengths", "row_ids")))

    def _write(self, window: Pieces) -> None:
        plan = pack_plan(window.lengths, self.max_seq_len)
        order = np.fromiter(chain.from_iterable(plan), dtype=np.int64, count=len(window.lengths))
        starts = (np.cumsum(window.lengths) - window.lengths)[order]
        lengths = window.lengths[order]
        index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        self.writer.add_samples(window.input_ids[index], window.labels[index], lengths, window.row_ids[order],
                                np.array([len(members) for members in plan], dtype=np.int64))


def _log_stats(stats: DataStats, path: str, log, max_seq_len: int, fmt: str) -> None:
    name = Path(path).name + (f" ({len(stats.shards)} shards)" if len(stats.shards) > 1 else "")
    if stats.num_rows_skipped:
        shown = "; ".join(f"{row_label(row_id, stats.row_unit, stats.shards)}: {reason}"
                          for row_id, reason in stats.skipped[:MAX_LOGGED_SKIPS])
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
