"""On-disk cache of tokenized (and packed) samples, keyed by everything that determines them.

    key = sha256(format version, sha256 of the data files (and the names of a glob's or directory's shards),
                 tokenizer, format, max_seq_len, packing, overflow, added tokens)

A data file's sha256 is remembered under `<root>/fingerprints/` with the file's path, size, mtime (ns), inode and
device, and reused while all five are unchanged, so that a warm start does not read a corpus of gigabytes again. A
file modified less than RACY_SECONDS before it was hashed is not remembered: a rewrite of the same size within
the file system's timestamp granularity would keep its mtime (git's "racy" rule).

An entry `<root>/tokenized/<key>/` holds the flat arrays of a token store (data/store.py; .npy, no pickle,
read through memory maps) and `stats.json`, with `manifest.json` written last: the size of every file and the
sha256 of every file but the two token files, whose blocks the store checks against its own crc32 checksums
(all at once when small, else as they are read: data/store.py). It is built in a temporary
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
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from isotrain.data.sources import resolve_source
from isotrain.data.store import FILES, TOKEN_FILES, TokenStore
from isotrain.disk import commit, sha256_file

# Bump when the arrays, their meaning (e.g. label shifting) or tokenization rules change.
CACHE_FORMAT = "isotrain-tokenized-v4"  # v4: the token store of data/store.py with block checksums
RACY_SECONDS = 2.0


class CacheUnreadable(Exception):
    """A cache entry exists but cannot be trusted; the caller rebuilds it."""


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("ISOTRAIN_CACHE") or Path.home() / ".cache" / "isotrain")


def _hash_path(digest, path: Path, memo_dir: Path | None = None) -> None:
    """Feed the sha256 of a file, or of every file under a directory (sorted by relative name), to `digest`."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        name = file.relative_to(path).as_posix() if path.is_dir() else ""
        digest.update(f"file:{name}:{file.stat().st_size}:{file_sha256(file, memo_dir)}\0".encode())


def file_sha256(path: Path, memo_dir: Path | None) -> str:
    """sha256 of the file at `path`, remembered in `memo_dir` (module docstring) when one is given."""
    if memo_dir is None:
        return sha256_file(path)
    before = path.stat()
    seen = {"path": str(path.resolve()), "size": before.st_size, "mtime_ns": before.st_mtime_ns,
            "inode": before.st_ino, "device": before.st_dev}
    memo = memo_dir / f"{hashlib.sha256(seen['path'].encode()).hexdigest()}.json"
    try:
        remembered = json.loads(memo.read_text())
        if remembered["seen"] == seen:
            return remembered["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path)
    after = path.stat()
    if (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size) \
            and time.time() - before.st_mtime_ns / 1e9 > RACY_SECONDS:
        memo_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps({"seen": seen, "sha256": digest}))
        os.replace(tmp, memo)  # two ranks writing at once leave one whole file
    return digest


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


def cache_key(data_path: str | list[tuple[str, Path]], tokenizer, options: dict, memo_dir: Path | None = None) -> str:
    """The entry name for `data_path` tokenized with `tokenizer` under the data `options`; the data files'
    sha256 are remembered in `memo_dir` if given. `data_path` is one file or saved-dataset directory, or the
    (name, file) shards of a glob or directory of shards: each shard's name (so the glob's expansion), size and
    sha256 are in the key (a shard's name and position number its rows, and its suffix decides the parsing)."""
    digest = hashlib.sha256()
    if isinstance(data_path, list):
        digest.update(f"{CACHE_FORMAT}\0shards:{len(data_path)}\0".encode())
        for name, file in data_path:
            digest.update(f"shard:{name}:{file.stat().st_size}:{file_sha256(file, memo_dir)}\0".encode())
    else:
        source = Path(data_path)
        # The kind of source decides how the bytes are parsed (.json vs .jsonl), so it is part of the key.
        kind = "directory" if source.is_dir() else source.suffix
        digest.update(f"{CACHE_FORMAT}\0{kind}\0".encode())
        _hash_path(digest, source, memo_dir)
    digest.update(f"\0tokenizer:{tokenizer_fingerprint(tokenizer)}\0".encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()


def source_fingerprint(path: str, field: str = "data.path") -> str:
    """sha256 of the data a source path names: a single file's own sha256, else that of every shard's (or saved
    dataset file's) name and sha256 (for a resume check: the same data, wherever it is read from)."""
    source = resolve_source(path, field)
    if not source.names and not source.saved_dataset:
        return sha256_file(source.files[0])
    digest = hashlib.sha256()
    if source.saved_dataset:
        _hash_path(digest, source.files[0])
    for name, file in zip(source.names, source.files):
        digest.update(f"shard:{name}:{sha256_file(file)}\0".encode())
    return digest.hexdigest()


def load_entry(entry: Path) -> tuple[TokenStore, dict] | None:
    """(samples, stats) of a cache entry, the samples memory-mapped (data/store.py); None if there is no entry;
    CacheUnreadable if it is damaged."""
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        if manifest.get("format") != CACHE_FORMAT:
            raise CacheUnreadable(f"format {manifest.get('format')!r}, not {CACHE_FORMAT!r}")
        expected = {*FILES, "stats.json"}
        if set(manifest["files"]) != expected:
            raise CacheUnreadable("manifest.json does not list the store's files")
        for name, meta in manifest["files"].items():
            path = entry / name
            if path.stat().st_size != meta["size"] or meta.get("sha256") != _content_hash(name, path):
                raise CacheUnreadable(f"{name} does not match manifest.json")
        stats = json.loads((entry / "stats.json").read_text())
        return TokenStore(entry), stats
    except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
        raise CacheUnreadable(f"{type(err).__name__}: {err}") from None


def _content_hash(name: str, path: Path) -> str | None:
    """The sha256 the manifest keeps for a file; None for the token files (the store checks their blocks)."""
    return None if name in TOKEN_FILES else sha256_file(path)


def _write_file(path: Path, write) -> None:
    try:
        with path.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        if err.filename is not None:
            raise
        # A short write can come without errno or file name.
        raise OSError(err.errno, f"{err.strerror or err}: the disk may be full", str(path)) from None


def save_entry(entry: Path, build: Callable[[Path], dict]) -> dict:
    """Build a cache entry atomically: `build(directory)` writes the token store into a temporary directory and
    returns the stats; the files are synced, listed with their sha256 in manifest.json (written last) and the
    directory renamed into place. Returns the stats."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name[:16]}-", dir=entry.parent))
    try:
        stats = build(tmp)
        _write_file(tmp / "stats.json", lambda h: h.write(json.dumps(stats, indent=1).encode()))
        for name in FILES:
            _sync(tmp / name)
        manifest = {
            "format": CACHE_FORMAT,
            "files": {name: {"size": (tmp / name).stat().st_size, "sha256": _content_hash(name, tmp / name)}
                      for name in (*FILES, "stats.json")},
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
    return stats


def _sync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def discard_entry(entry: Path) -> None:
    """Remove an entry by first renaming it away, so no reader ever sees it half-deleted."""
    trash = entry.parent / f".trash-{entry.name[:16]}-{uuid.uuid4().hex}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
