"""A Hugging Face cache written the way huggingface_hub writes it, so that tests resolve Hub ids offline.

    <hub>/models--org--name/
        blobs/<id>                      file contents; id = sha256 for LFS files (weights), git's blob sha1 otherwise
        snapshots/<commit>/<path>       relative symlinks to ../../blobs/<id>
        refs/<branch or tag>            the commit hash, no newline
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".model", ".pth")


def blob_id(path: str, data: bytes) -> str:
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_snapshot(hub_dir: Path, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",),
                   repo_type: str = "model") -> str:
    """Add a commit holding `files` (path in the repository -> bytes) to `repo_id`'s cache; each of `refs` then
    names it. Returns the commit hash (derived from the files, like git's)."""
    repo = Path(hub_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    ids = {path: blob_id(path, data) for path, data in files.items()}
    commit = hashlib.sha1("".join(f"{path}:{ids[path]}\n" for path in sorted(ids)).encode()).hexdigest()
    for path, data in files.items():
        blob = repo / "blobs" / ids[path]
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


def directory_files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by its path relative to it (a saved model as a repository's files)."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@contextmanager
def offline_home(monkeypatch, home: Path):
    """Point this process at the Hugging Face home `home`, offline, with isotrain's remembered snapshots forgotten
    before and after (they belong to whatever cache was set before)."""
    from isotrain.hub import forget_resolved

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    forget_resolved()
    try:
        yield home
    finally:
        forget_resolved()
