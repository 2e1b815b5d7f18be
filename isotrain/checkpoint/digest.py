"""The manifest's hash: BLAKE3 of each piece of a file (checkpoints written before BLAKE3 list one
sha256 per whole file, checked with `isotrain.disk.sha256_file`).

A file is cut into pieces: the first `first_bytes` bytes (for a safetensors file, its header, so
that a reader can trust the header before it plans a single read), then pieces of `PIECE_BYTES`
(16 MiB), the last one shorter. The manifest lists one BLAKE3 digest per piece. A piece can be
checked by whoever reads it, alone: a resume on N ranks checks each piece exactly once, on a rank
that reads it anyway, while a single whole-file digest would make one process read every byte of
a file in order. `isotrain ckpt verify` checks every piece.
"""

from __future__ import annotations

import os
from pathlib import Path

from blake3 import blake3

HASH = "blake3"  # the manifest's "hash" field and the per-file key of the piece digests
LEGACY_HASH = "sha256"  # manifests of version 1: one sha256 per whole file
PIECE_BYTES = 16 << 20


def piece_ranges(num_bytes: int, first_bytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """[start, stop) of every piece of a file of `num_bytes` bytes; an empty file is one empty piece."""
    first = min(first_bytes, num_bytes)
    ranges = [(0, first)]
    for start in range(first, num_bytes, piece_bytes):
        ranges.append((start, min(start + piece_bytes, num_bytes)))
    return ranges


class PieceDigest:
    """BLAKE3 of each piece of a stream of bytes fed in order to `update` (it splits at the piece edges)."""

    def __init__(self, first_bytes: int = PIECE_BYTES, piece_bytes: int = PIECE_BYTES):
        if first_bytes <= 0 or piece_bytes <= 0:
            raise ValueError("pieces must hold at least one byte")
        self.piece_bytes, self.first_bytes = piece_bytes, first_bytes
        self.digests: list[str] = []
        self.num_bytes = 0
        self._hasher, self._left, self._fed = blake3(), first_bytes, 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(self._left, len(view))
            self._hasher.update(view[:take])  # the blake3 package releases the GIL on large inputs
            self._left -= take
            self._fed += take
            self.num_bytes += take
            view = view[take:]
            if self._left == 0:
                self._close_piece()

    def _close_piece(self) -> None:
        self.digests.append(self._hasher.hexdigest())
        self._hasher, self._left, self._fed = blake3(), self.piece_bytes, 0

    def finish(self) -> tuple[list[str], int]:
        """(digest of every piece, length of the first piece)."""
        if self._fed or not self.digests:
            self._close_piece()
        return self.digests, min(self.first_bytes, self.num_bytes)


def read_exactly(fd: int, view: memoryview, offset: int) -> int:
    """pread into `view` until it is full or the file ends; returns the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def file_pieces_ok(path: Path, num_bytes: int, first_bytes: int, digests: list[str],
                   count: int | None = None) -> str | None:
    """Hash the first `count` pieces of `path` (all by default) in one sequential read; the first
    piece that differs, as a sentence, or None."""
    ranges = piece_ranges(num_bytes, first_bytes)
    if len(ranges) != len(digests):
        return f"{path} has {len(ranges)} pieces but the manifest lists {len(digests)} digests"
    ranges = ranges[:count]
    buffer = memoryview(bytearray(min(max(first_bytes, PIECE_BYTES), max(num_bytes, 1))))
    fd = os.open(path, os.O_RDONLY)
    try:
        for (start, stop), expected in zip(ranges, digests):
            piece = buffer[: stop - start]
            if read_exactly(fd, piece, start) != len(piece) or blake3(piece).hexdigest() != expected:
                return piece_mismatch(path, start, stop)
    finally:
        os.close(fd)
    return None


def piece_mismatch(path: Path, start: int, stop: int) -> str:
    return f"{path} (bytes {start}-{stop}) does not match its {HASH} in the manifest (altered or corrupted)"
