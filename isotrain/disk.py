"""Durable file operations shared by the data cache and the checkpoint engine.

They sit at the bottom of the package (they import nothing from isotrain) because both
`data/cache.py` and `checkpoint/` need them and data/ is below checkpoint/: a helper two rooms
share belongs in the lower one.

- `commit`: give a fully written file or directory its real name atomically (invariant 5).
- `fsync_dir`: put a directory's list of names on disk.
- `sha256_file`: the sha256 of a file's bytes, read in fixed-size blocks (memory does not grow
  with the file).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

SHA256_BLOCK_BYTES = 16 << 20


def sha256_file(path: str | os.PathLike, block_bytes: int = SHA256_BLOCK_BYTES) -> str:
    """Hex sha256 of the bytes of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, aside: str | None = None) -> None:
    """Give `tmp`, written in full (a file or a directory, every file in it fsynced), the name `final`.

    A reader sees the old `final` or the new one, never a part: fsync `tmp`'s list of names (a
    directory), rename (atomic), then fsync the parent so that the new name itself is on disk.
    A file replaces an existing `final` in that one rename; a directory can replace only an empty
    one, so with `aside` an existing `final` directory is first renamed to `<final>.<aside>` and
    deleted after the commit (in between no `final` exists); without it, renaming onto a non-empty
    directory raises OSError and leaves both as they were.
    """
    if tmp.is_dir():
        fsync_dir(tmp)
    old = None
    if aside is not None and final.is_dir():
        old = final.with_name(f"{final.name}.{aside}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
