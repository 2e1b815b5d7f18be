"""Durable file writing: bytes are hashed as they are written, fsynced, and replaced atomically.

Every checkpoint file goes through `write_chunks` (or `StreamingFile`), so its BLAKE3 piece digests
(digest.py) cost no second read of the data
and no file is ever reported written before it is on disk (invariant 5). Everything that must appear
whole or not at all (a checkpoint, an exported model, a data-cache entry, `latest`, config.yaml) is
written under a temporary name and given its real one by `commit` (isotrain/disk.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from isotrain.checkpoint.digest import HASH, PIECE_BYTES, PieceDigest
from isotrain.disk import commit

CHUNK_BYTES = 16 << 20  # hash and write in pieces that stay in cache between the two

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class FileEntry:
    """A written file as the manifest lists it: its size and the BLAKE3 digest of each piece."""

    num_bytes: int
    digests: tuple[str, ...]
    first_piece_bytes: int

    def as_json(self) -> dict:
        return {"bytes": self.num_bytes, HASH: list(self.digests), "first_piece_bytes": self.first_piece_bytes}

    @classmethod
    def of(cls, digest: PieceDigest) -> FileEntry:
        digests, first = digest.finish()
        return cls(digest.num_bytes, tuple(digests), first)


def with_path(err: OSError, path: Path) -> OSError:
    """`os.write` and `os.fsync` errors name no file; a user needs to know which one failed."""
    if err.filename is not None:
        return err
    named = OSError(err.errno, err.strerror or str(err), str(path))
    named.__cause__ = err
    return named


def _sync_file_range():
    """Linux's sync_file_range(2), or None where the C library has no such function."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, num_bytes: int) -> None:
    """Ask the kernel to start writing these bytes to disk now, without waiting for it.

    For writes through the page cache (small files, and checkpoint files where the file system
    refuses direct I/O). A checkpoint stays far below the kernel's dirty-page limits, so without
    this the disk would start on a file only at its fsync, and hashing, transfers and disk writes would take turns;
    with it they overlap and the closing fsync waits only for the last pieces. It is a hint:
    durability and every error come from that fsync.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, num_bytes, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data):]


def write_chunks(path: Path, chunks: Iterable[bytes | memoryview], first_piece_bytes: int = PIECE_BYTES) -> FileEntry:
    """Create `path` (never overwriting), write the chunks, fsync; return size and piece digests
    (`first_piece_bytes`: a safetensors file's header length, see digest.py)."""
    digest = PieceDigest(first_piece_bytes)
    num_bytes = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                piece = view[start : start + CHUNK_BYTES]
                digest.update(piece)  # releases the GIL: files written by several threads overlap
                _write_all(fd, piece)
                start_writeback(fd, num_bytes + start, len(piece))
            num_bytes += len(view)
        os.fsync(fd)
    except OSError as err:
        raise with_path(err, path) from None
    finally:
        os.close(fd)
    return FileEntry.of(digest)


def write_text(path: Path, text: str) -> FileEntry:
    return write_chunks(path, [text.encode("utf-8")])


def write_json(path: Path, value) -> FileEntry:
    return write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` so that a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    write_text(tmp, text)
    commit(tmp, path)


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header for tensors laid out in the given order (8-byte aligned, as the format asks)."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FileEntry:
    """Stream CPU tensors into a safetensors file that `safetensors.safe_open` and transformers read."""
    header = safetensors_header(tensors, metadata)
    return write_chunks(path, [header, *(tensor_view(t) for t in tensors.values())], first_piece_bytes=len(header))


def read_safetensors_header(path: Path) -> dict:
    """The parsed header of a safetensors file; ValueError with the reason when it is not one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError("shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise ValueError(f"header length {header_len} exceeds the file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    end = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = spec["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r} has no valid data_offsets") from None
        end = max(end, stop)
    if 8 + header_len + end != size:
        raise ValueError(f"data ends at byte {8 + header_len + end} but the file has {size} bytes")
    return header
