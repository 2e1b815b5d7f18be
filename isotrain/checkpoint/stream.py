"""One checkpoint file written as a stream: bytes are gathered into two page-aligned buffers (16 MB,
or smaller when asked), and each full buffer is hashed on one thread while another writes it with
direct I/O. The hash is BLAKE3 per piece (digest.py).

Direct I/O (O_DIRECT) moves the bytes from the buffer to the device without the page cache. On
the machines measured (docs/benchmarks.md) writing through the page cache cost the kernel about
2 s of CPU per GB and ran at a third of the device's speed; a checkpoint is not read back by the
process that wrote it, so the cache gives it nothing. Where a file system refuses direct I/O the
same stream goes through the page cache, with an early writeback hint per piece. Either way the
closing fsync is what makes the file durable (and flushes the device's own cache).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from isotrain.checkpoint.digest import PieceDigest
from isotrain.checkpoint.files import CHUNK_BYTES, FileEntry, start_writeback, with_path

BUFFERS = 2  # one filled while the other is hashed and written
ALIGN = 4096  # direct I/O needs buffer address, file offset and length in multiples of the block size


def _enable_direct(fd: int) -> bool:
    """Switch an open file to direct I/O; False where the file system does not support it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError:
        return False
    return True


def _disable_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))


class StreamingFile:
    """A file of `size` bytes (header included) created at `path` and written by `append` calls in
    order. Two buffers alternate: one is filled while the other is hashed and written, so copying,
    hashing and the disk overlap; `close` writes the unaligned tail through the page cache, fsyncs
    and returns size and BLAKE3 piece digests (the header is the first piece, see digest.py)."""

    def __init__(self, path: Path, header: bytes, size: int, direct: bool = True, piece_bytes: int = CHUNK_BYTES):
        self.path, self.size, self.num_bytes = path, size, 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.direct = direct and _enable_direct(self._fd)
        length = min(piece_bytes, -(-size // ALIGN) * ALIGN) or ALIGN
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # counted as the process's own memory
        self._buffers = [mmap.mmap(-1, length, flags=private) for _ in range(BUFFERS)]  # page-aligned
        self._busy: list[list[Future]] = [[] for _ in range(BUFFERS)]
        self._current, self._fill, self._offset = 0, 0, 0
        self._digest = PieceDigest(first_bytes=max(1, len(header)))
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="write")
        self.append(memoryview(header))

    def append(self, data: memoryview) -> None:
        data, start = data.cast("B"), 0
        while start < len(data):
            if self._fill == 0:
                self._settle(self._current)  # this buffer's previous piece is hashed and written
            buffer = self._buffers[self._current]
            count = min(len(buffer) - self._fill, len(data) - start)
            buffer[self._fill : self._fill + count] = data[start : start + count]
            self._fill += count
            start += count
            if self._fill == len(buffer):
                self._dispatch()
        self.num_bytes += len(data)

    def _dispatch(self) -> None:
        """Hash and write the current buffer in the background, and move on to the other one."""
        piece = memoryview(self._buffers[self._current])[: self._fill]
        self._busy[self._current] = [self._hasher.submit(self._digest.update, piece),
                                     self._writer.submit(self._write, piece, self._offset)]
        self._offset += self._fill
        self._current, self._fill = (self._current + 1) % BUFFERS, 0

    def _write(self, piece: memoryview, offset: int) -> None:
        first, count = offset, len(piece)
        if self.direct and len(piece) % ALIGN:  # the file's last piece: its whole blocks go direct
            head = len(piece) - len(piece) % ALIGN
            if head:
                self._write(piece[:head], offset)
            _disable_direct(self._fd)
            self.direct = False
            piece, offset = piece[head:], offset + head
        while len(piece):
            try:
                written = os.pwrite(self._fd, piece, offset)
            except OSError as err:
                if err.errno != errno.EINVAL or not self.direct:
                    raise with_path(err, self.path) from None
                written = 0  # a direct write a file-size limit would cut: retried below for the real error
            if written < len(piece) and self.direct:
                # What is left after a short or refused direct write goes through the page cache, so
                # that a file-size limit or full disk is reported as such rather than as EINVAL.
                _disable_direct(self._fd)
                self.direct = False
            piece, offset = piece[written:], offset + written
        if not self.direct:
            start_writeback(self._fd, first, count)

    def _settle(self, index: int) -> None:
        """Wait for a buffer's hash and write; the first error is raised here."""
        busy, self._busy[index] = self._busy[index], []
        for future in busy:
            future.result()

    def close(self) -> FileEntry:
        try:
            if self._fill:
                self._dispatch()
            for index in range(len(self._busy)):
                self._settle(index)
            os.fsync(self._fd)
        except OSError as err:
            self.abort()
            raise with_path(err, self.path) from None
        self._release()
        if self.num_bytes != self.size:
            raise ValueError(f"{self.path}: wrote {self.num_bytes} bytes, planned {self.size}")
        return FileEntry.of(self._digest)

    def abort(self) -> None:
        """Stop after an error elsewhere: wait for the background work (its errors do not matter
        now) and close the file; the caller removes the directory."""
        for index in range(len(self._busy)):
            try:
                self._settle(index)
            except OSError:
                pass
        self._release()

    def _release(self) -> None:
        self._hasher.shutdown()
        self._writer.shutdown()
        self._buffers = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
