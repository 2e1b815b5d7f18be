"""Names on disk: which directories are committed checkpoints, which are leftovers, and `latest`.

Only a directory named exactly `step-XXXXXXXX` is a committed checkpoint: the name is given by an
atomic rename after every file, and the manifest, are on disk. Everything else is in progress or a
leftover of a crash (`step-XXXXXXXX.tmp-<id>` being written, `.old-<id>` being deleted).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from isotrain.checkpoint.files import atomic_write_text

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
_COMMITTED = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^(step-\d{8}|model)\.(tmp|old)-[0-9a-z-]+$|^\.latest\.tmp-\d+$")
_SET_ASIDE = re.compile(r"^step-\d{8}\.skipped-[0-9a-z]+$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _COMMITTED.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def leftovers(root: Path) -> list[Path]:
    """Directories and files that a crash during a save or a rotation left behind."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if _LEFTOVER.match(path.name))


def remove_leftovers(root: Path) -> list[Path]:
    removed = leftovers(root)
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def set_aside_newer(root: Path, step: int, tag: str) -> list[tuple[Path, Path]]:
    """Rename committed checkpoints newer than `step` out of the committed namespace.

    After a resume from an older checkpoint (the newer ones were invalid, or the user chose an
    older one) the newer ones belong to another history: left in place, rotation would keep them
    and delete the run's own new checkpoints, and the next `resume=auto` would pick them. Renamed,
    their bytes stay on disk for the user to inspect or delete.
    """
    moved = []
    for found_step, path in committed(root):
        if found_step > step:
            target = path.with_name(f"{path.name}.skipped-{tag}")
            path.rename(target)
            moved.append((path, target))
    return moved


def set_aside(root: Path) -> list[Path]:
    """Checkpoints that `set_aside_newer` moved out of the way."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if _SET_ASIDE.match(path.name))


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")
