"""On-disk cache of tokenized (and packed) samples, keyed by everything that determines them.

    key = sha256(format version, data bytes, tokenizer, format, max_seq_len, packing, added tokens)

An entry `<root>/tokenized/<key>/` holds flat numpy arrays (no pickle) and `stats.json`, with
`manifest.json` (size and sha256 of every file) written last. It is built in a temporary
directory and renamed into place, so a reader sees a whole entry or none, and two ranks writing
at once both succeed (the second rename loses and its copy is discarded). An entry that fails the
manifest check is reported and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np

from isotrain.data.packing import Sample
from isotrain.disk import commit, sha256_file

# Bump when the arrays, their meaning (e.g. label shifting) or tokenization rules change.
CACHE_FORMAT = "isotrain-tokenized-v2"  # v2: manifest sha256 is the plain sha256 of a file
_ARRAYS = ("input_ids", "labels", "sample_offsets", "doc_lengths", "doc_row_ids", "sample_doc_offsets")


class CacheUnreadable(Exception):
    """A cache entry exists but cannot be trusted; the caller rebuilds it."""


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("ISOTRAIN_CACHE") or Path.home() / ".cache" / "isotrain")


def _hash_path(digest, path: Path) -> None:
    """Feed a file's bytes, or every file under a directory (sorted by relative name), to `digest`."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        name = file.relative_to(path).as_posix() if path.is_dir() else ""
        digest.update(f"file:{name}:{file.stat().st_size}\0".encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides token ids: the tokenizer's vocabulary/rules, specials and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # a slow (Python) tokenizer: its saved files describe it
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            _hash_path(digest, Path(tmp))
    extras = {
        "class": type(tokenizer).__name__,
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
        "special": list(tokenizer.all_special_tokens),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "size": len(tokenizer),
    }
    digest.update(json.dumps(extras, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(data_path: str, tokenizer, options: dict) -> str:
    """The entry name for `data_path` tokenized with `tokenizer` under the data `options`."""
    digest = hashlib.sha256()
    source = Path(data_path)
    # The kind of source decides how the bytes are parsed (.json vs .jsonl), so it is part of the key.
    kind = "directory" if source.is_dir() else source.suffix
    digest.update(f"{CACHE_FORMAT}\0{kind}\0".encode())
    _hash_path(digest, source)
    digest.update(f"\0tokenizer:{tokenizer_fingerprint(tokenizer)}\0".encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()


def _flatten(samples: list[Sample]) -> dict[str, np.ndarray]:
    doc_lengths, doc_row_ids, docs_per_sample = [], [], []
    for sample in samples:
        boundaries = np.flatnonzero(sample.position_ids == 0).tolist() + [len(sample)]
        doc_lengths.extend(np.diff(boundaries).tolist())
        doc_row_ids.extend(sample.row_ids)
        docs_per_sample.append(len(sample.row_ids))
    lengths = [len(sample) for sample in samples]
    return {
        # int32 halves the size; token ids and -100 fit easily.
        "input_ids": np.concatenate([s.input_ids for s in samples]).astype(np.int32),
        "labels": np.concatenate([s.labels for s in samples]).astype(np.int32),
        "sample_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "doc_lengths": np.asarray(doc_lengths, dtype=np.int64),
        "doc_row_ids": np.asarray(doc_row_ids, dtype=np.int64),
        "sample_doc_offsets": np.concatenate([[0], np.cumsum(docs_per_sample)]).astype(np.int64),
    }


def _unflatten(arrays: dict[str, np.ndarray]) -> list[Sample]:
    from isotrain.data.packing import sample_from_documents
    from isotrain.data.tokenize import Example

    offsets, doc_offsets = arrays["sample_offsets"], arrays["sample_doc_offsets"]
    doc_lengths, doc_row_ids = arrays["doc_lengths"], arrays["doc_row_ids"]
    if offsets[-1] != len(arrays["input_ids"]) or len(arrays["labels"]) != len(arrays["input_ids"]):
        raise CacheUnreadable("token arrays do not match their offsets")
    if doc_offsets[-1] != len(doc_lengths) or len(doc_row_ids) != len(doc_lengths):
        raise CacheUnreadable("document arrays do not match their offsets")
    input_ids = arrays["input_ids"].astype(np.int64)
    labels = arrays["labels"].astype(np.int64)
    samples = []
    for s in range(len(offsets) - 1):
        documents, start = [], offsets[s]
        for d in range(doc_offsets[s], doc_offsets[s + 1]):
            end = start + doc_lengths[d]
            documents.append(Example(input_ids[start:end], labels[start:end], int(doc_row_ids[d])))
            start = end
        if start != offsets[s + 1] or not documents:
            raise CacheUnreadable(f"sample {s} does not match its document lengths")
        samples.append(sample_from_documents(documents))
    return samples


def load_entry(entry: Path) -> tuple[list[Sample], dict] | None:
    """(samples, stats) of a cache entry, None if there is none; CacheUnreadable if it is damaged."""
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        for name, meta in manifest["files"].items():
            path = entry / name
            if path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                raise CacheUnreadable(f"{name} does not match manifest.json")
        arrays = {name: np.load(entry / f"{name}.npy", allow_pickle=False) for name in _ARRAYS}
        stats = json.loads((entry / "stats.json").read_text())
        return _unflatten(arrays), stats
    except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
        raise CacheUnreadable(f"{type(err).__name__}: {err}") from None


def _write_file(path: Path, write) -> None:
    try:
        with path.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        if err.filename is not None:
            raise
        # numpy reports a short write without errno or file ("N requested and M written").
        raise OSError(err.errno, f"{err.strerror or err}: the disk may be full", str(path)) from None


def save_entry(entry: Path, samples: list[Sample], stats: dict) -> None:
    """Write a cache entry atomically (temporary directory + rename); discard a damaged one first."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name[:16]}-", dir=entry.parent))
    try:
        files = {}
        for name, array in _flatten(samples).items():
            _write_file(tmp / f"{name}.npy", lambda h, a=array: np.save(h, a, allow_pickle=False))
            files[f"{name}.npy"] = None
        _write_file(tmp / "stats.json", lambda h: h.write(json.dumps(stats, indent=1).encode()))
        files["stats.json"] = None
        manifest = {
            "format": CACHE_FORMAT,
            "files": {name: {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in files},
        }
        _write_file(tmp / "manifest.json", lambda h: h.write(json.dumps(manifest, indent=1).encode()))
        try:
            commit(tmp, entry)
        except OSError:
            # Another process renamed its (identical) entry into place first; keep that one.
            if not entry.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def discard_entry(entry: Path) -> None:
    """Remove an entry by first renaming it away, so no reader ever sees it half-deleted."""
    trash = entry.parent / f".trash-{entry.name[:16]}-{uuid.uuid4().hex}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
