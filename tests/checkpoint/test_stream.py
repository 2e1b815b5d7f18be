"""The file writer under every save (isotrain/checkpoint/stream.py) and the order in which a save
feeds it: exact bytes and BLAKE3 piece digests for every way a stream can end, direct I/O or the page cache, a
file-size limit hit in the middle of a direct-I/O piece, and a write order that keeps every file
moving without reordering any file's tensors."""

from __future__ import annotations

import errno

import pytest
import torch
from blake3 import blake3

from helpers import HANG_S
from zygote import fork_ranks, shared_zygote

from isotrain.checkpoint.digest import piece_ranges
from isotrain.checkpoint.files import CHUNK_BYTES
from isotrain.checkpoint.save import write_order
from isotrain.checkpoint.state import Item
from isotrain.checkpoint.stream import ALIGN, StreamingFile

SIZES = [1, ALIGN - 1, ALIGN, 3 * ALIGN + 17, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + ALIGN,
         2 * CHUNK_BYTES + 5 * ALIGN + 123]


def pieces(total: int, seed: int) -> list[bytes]:
    """Random bytes cut at random places, so that appends cross buffer boundaries anywhere."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    cuts = sorted(torch.randint(0, total + 1, (6,), generator=generator).tolist())
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, total])]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("total", SIZES)
@pytest.mark.parametrize("buffer_bytes", [CHUNK_BYTES, 4 << 20], ids=["16MB", "4MB"])
def test_a_stream_writes_exactly_its_bytes_and_their_digests(tmp_path, total, direct, buffer_bytes):
    header, *body = pieces(total, seed=total)
    path = tmp_path / "file.safetensors"
    stream = StreamingFile(path, header, total, direct=direct, piece_bytes=buffer_bytes)
    for piece in body:
        stream.append(memoryview(piece))
    entry = stream.close()
    expected = b"".join([header, *body])
    assert path.read_bytes() == expected
    # The header is the first piece, then 16 MB pieces whatever the buffers' size.
    first = max(1, len(header))
    digests = tuple(blake3(expected[a:b]).hexdigest() for a, b in piece_ranges(total, first))
    assert (entry.num_bytes, entry.digests, entry.first_piece_bytes) == (total, digests, min(first, total))
    assert len(digests) == 1 + max(0, -(-(total - first) // CHUNK_BYTES))


def test_a_stream_that_ends_short_of_its_planned_size_is_refused(tmp_path):
    stream = StreamingFile(tmp_path / "file", b"x" * 10, 11)
    with pytest.raises(ValueError, match="wrote 10 bytes, planned 11"):
        stream.close()


LIMITED = """
import resource, signal, sys
from pathlib import Path
from isotrain.checkpoint.stream import StreamingFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
stream = StreamingFile(Path(sys.argv[1]), b"h" * 100, {size})
try:
    stream.append(memoryview(b"d" * ({size} - 100)))
    stream.close()
except OSError as err:
    print(err.errno, err.filename, err.strerror)
    sys.exit(3)
"""


def test_a_file_size_limit_inside_a_direct_piece_reports_the_file_too_large(tmp_path):
    """The limit cuts a direct write short at a place that is no block boundary: the rest must fail
    with EFBIG (as on a full disk), not with the EINVAL an unaligned direct write would give."""
    size, limit = CHUNK_BYTES + 2 * ALIGN, CHUNK_BYTES // 2 + 1000
    path = tmp_path / "big.safetensors"
    # A process of its own (forked from the zygote: no interpreter start-up), so that the limit binds it alone.
    script, log = tmp_path / "limited.py", tmp_path / "limited.out"
    script.write_text(LIMITED.format(limit=limit, size=size))
    forked = fork_ranks(shared_zygote(), 1, [str(path)], [log], errs=[tmp_path / "limited.err"], script=script)
    forked.finish(HANG_S)
    assert forked.exit_codes() == [3], (tmp_path / "limited.err").read_text()
    number, filename, _ = log.read_text().split(" ", 2)
    assert int(number) == errno.EFBIG and filename == str(path), log.read_text()


def item(key: str, rows: int, owner: int, kind: str = "model") -> Item:
    return Item(key, kind, (rows, 4), torch.float32, torch.zeros(rows, 4), owner=owner)


def test_the_write_order_keeps_each_files_tensor_order_and_moves_all_files_together():
    files = {
        "model-00001-of-00002.safetensors": [item(f"a{i}", 10 + i, 0) for i in range(5)],
        "model-00002-of-00002.safetensors": [item(f"b{i}", 100, 1) for i in range(3)],
        "train_state/optimizer.safetensors": [item(f"c{i}", 1, 0, "optimizer") for i in range(20)],
    }
    order = write_order(files)
    assert sorted(i.key for i in order) == sorted(i.key for its in files.values() for i in its)
    for its in files.values():
        assert [i for i in order if i in its] == its
    # Whenever an item starts, no file is more than one tensor ahead of any other in its share of bytes.
    totals = {name: sum(i.num_bytes for i in its) for name, its in files.items()}
    done = dict.fromkeys(files, 0)
    for next_item in order:
        name = next(n for n, its in files.items() if next_item in its)
        others = [done[n] / totals[n] for n in files if n != name and done[n] < totals[n]]
        assert all(done[name] / totals[name] <= share + 1e-12 for share in others)
        done[name] += next_item.num_bytes
