"""Resume in one pass: a load checks the bytes it read against the manifest before the run takes a step.

Before any load, rank 0 checks the manifest, every size, every small file and every safetensors
header (`verify_checkpoint(defer_tensor_data=True)`). The data pieces of the safetensors files
(16 MiB each, one BLAKE3 digest per piece in the manifest, see digest.py) are checked here, after
the ranks have read their parts straight into the model and optimizer tensors:

1. each rank counts, for every piece, how many of its bytes it holds in memory (the reads it made
   into kept tensors, `CheckpointReader(record=True)`);
2. one all-gather of those counts; each piece is given to the rank that holds most of it (ties: the
   rank given fewer bytes so far), a piece no rank read to the least-loaded rank, the same plan on
   every rank, so that every piece is checked exactly once across ranks;
3. each rank hashes its pieces: the bytes it holds from the memory they were read into (what the
   run trains on), the rest of the piece (other ranks' rows, tensors nobody loaded) read from disk;
4. one all-gather of the problems: every rank returns the same verdict.

A piece that does not match names its file; the caller then loads the previous checkpoint into
the same tensors (manager.py), so nothing is trained on bytes that were not checked.
"""

from __future__ import annotations

import bisect
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from blake3 import blake3

from isotrain.checkpoint.digest import HASH, piece_mismatch, read_exactly
from isotrain.checkpoint.manifest import is_legacy, is_tensor_file, pieces, read_manifest

Piece = tuple[str, int, int, str]  # file (relative), start, stop, expected digest


def data_pieces(manifest: dict) -> list[Piece]:
    """The pieces a resume checks while loading: every piece of every safetensors file but the first
    (its header, checked before the load)."""
    out = []
    for name, spec in sorted(manifest["files"].items()):
        if is_tensor_file(name):
            for (start, stop), digest in list(zip(pieces(spec), spec[HASH]))[1:]:
                out.append((name, start, stop, digest))
    return out


def _held(piece: Piece, loaded: list[tuple[int, memoryview]], offsets: list[int]) -> list[tuple[int, memoryview]]:
    """The parts of `piece` this rank holds in memory, in file order, without overlaps (`loaded` is
    sorted by offset, `offsets` its offsets)."""
    _, start, stop, _ = piece
    parts, cursor = [], start
    for offset, view in loaded[max(0, bisect.bisect_right(offsets, start) - 1):]:
        if offset >= stop:
            break
        begin, end = max(offset, cursor), min(offset + len(view), stop)
        if end > begin:
            parts.append((begin, view[begin - offset : end - offset]))
            cursor = end
    return parts


def assign(counts: list[list[int]], sizes: list[int]) -> list[int]:
    """The rank that checks each piece, from every rank's count of the piece's bytes it holds."""
    assigned = [0] * len(counts)
    owners = []
    for index, size in enumerate(sizes):
        owner = min(range(len(counts)), key=lambda r: (-counts[r][index], assigned[r], r))
        assigned[owner] += size
        owners.append(owner)
    return owners


def check_piece(directory: Path, piece: Piece, held: list[tuple[int, memoryview]]) -> str | None:
    """Hash one piece from the memory that holds it and the disk for the rest; the problem or None."""
    name, start, stop, expected = piece
    path = directory / name
    hasher, cursor = blake3(), start
    fd = os.open(path, os.O_RDONLY)
    try:
        for begin, view in [*held, (stop, memoryview(b""))]:
            if begin > cursor:  # bytes this rank did not read: from disk
                gap = memoryview(bytearray(begin - cursor))
                if read_exactly(fd, gap, cursor) != len(gap):
                    return f"{path} ends before byte {stop} (truncated)"
                hasher.update(gap)
            hasher.update(view)
            cursor = begin + len(view)
    finally:
        os.close(fd)
    return None if hasher.hexdigest() == expected else piece_mismatch(path, start, stop)


def _all_gather(value, world_size: int, group) -> list:
    if world_size == 1:
        return [value]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def check_loaded(directory: Path, loaded: dict[Path, list[tuple[int, memoryview]]], rank: int, world_size: int,
                 group, threads: int | None = None) -> str | None:
    """The first problem with the checkpoint's tensor data, the same on every rank, or None when every
    piece matches. Every rank calls it after its load; `loaded` is its reader's record."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if is_legacy(manifest):  # a whole-file sha256 cannot be checked by parts: rank 0 hashed it all first
        return None
    by_file = {path.relative_to(directory).as_posix(): sorted(reads, key=lambda r: r[0])
               for path, reads in loaded.items()}
    work = data_pieces(manifest)
    offsets = {name: [offset for offset, _ in reads] for name, reads in by_file.items()}
    held = [_held(piece, by_file.get(piece[0], []), offsets.get(piece[0], [])) for piece in work]
    counts = _all_gather([sum(len(view) for _, view in parts) for parts in held], world_size, group)
    owners = assign(counts, [stop - start for _, start, stop, _ in work])
    mine = [(piece, parts) for piece, parts, owner in zip(work, held, owners) if owner == rank]
    # Hashing releases the GIL, and the pieces are independent: as many threads as torch uses.
    with ThreadPoolExecutor(max(1, threads or torch.get_num_threads())) as pool:
        found = [p for p in pool.map(lambda job: check_piece(directory, *job), mine) if p]
    problems = _all_gather(found[:1], world_size, group)
    return next((problem for found in problems for problem in found), None)

