"""Ring attention (isotrain/parallel/ring.py) alone against SDPA over whole rows, fp64, on 2 and 4 real gloo ranks:
the output and the gradients of q, k and v, for 4 query heads with 4, 2 and 1 key/value heads (CP 4 with 1 KV head:
more ranks than KV heads, which Ulysses cannot split), plain causal rows and packed rows whose documents cross the
zig-zag pieces. Two deliberate breaks must fail the same comparison: blocks merged without their log-sum-exp
weights, and the diagonal block attended without its causal mask. Without processes: the zig-zag pieces give every
rank the same causal work, and cut every sequence tensor of a micro-batch alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("ring_worker.py"))
FP64_RTOL = 1e-12
CASES = {f"kv{kv}-{kind}" for kv in (4, 2, 1) for kind in ("causal", "packed")}


def run(tmp_path, nproc: int, *flags: str) -> dict:
    out = tmp_path / f"ring-{nproc}-{'-'.join(flags)}.json"
    proc = run_forked_ranks(nproc, [str(out), *flags], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_attention_equals_whole_row_attention(tmp_path, nproc):
    errors = run(tmp_path, nproc)
    assert set(errors) == CASES
    for case, values in errors.items():
        assert set(values) == {"out", "dq", "dk", "dv"}
        assert max(values.values()) <= FP64_RTOL, (case, values)


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["nolse", "nodiagonal"])
def test_broken_ring_attention_fails_the_comparison(tmp_path, broken):
    errors = run(tmp_path, 2, f"break={broken}")
    for case, values in errors.items():
        assert values["out"] > 1e-3, (case, values)


def computed_pairs(pieces) -> list[int]:
    """Per rank, the query-key pairs its blocks compute (rows × columns of every block not skipped)."""
    import torch

    from isotrain.parallel.ring import _block

    cp = pieces.shape[0]
    work = []
    for i in range(cp):
        blocks = [_block(pieces, None, i, j, torch.device("cpu")) for j in range(cp)]
        work.append(sum(len(range(*b[0].indices(pieces.shape[1]))) * len(range(*b[1].indices(pieces.shape[1])))
                        for b in blocks if b is not None))
    return work


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_pieces_give_every_rank_the_same_causal_work(cp):
    """Rank r holds chunks r and 2cp-1-r: every position once, increasing within a piece, and every rank computes
    as many query-key pairs (contiguous pieces would give the last rank cp times the first's)."""
    import torch

    from isotrain.parallel.cp import piece_indices

    length = 2 * cp * 3
    pieces = piece_indices(length, cp, "ring")
    assert sorted(pieces.flatten().tolist()) == list(range(length))
    assert all(bool((piece[1:] > piece[:-1]).all()) for piece in pieces)
    assert len(set(computed_pairs(pieces))) == 1
    contiguous = computed_pairs(piece_indices(length, cp, "ulysses"))
    assert contiguous[-1] == cp * contiguous[0]
    assert torch.equal(pieces[0][:3], torch.arange(3)) and torch.equal(pieces[0][3:], torch.arange(length - 3, length))


def test_ring_piece_cuts_every_sequence_tensor_alike():
    """local_piece under ring: ids, labels, positions, documents and loss weights keep their token's place."""
    import torch

    from isotrain.parallel.cp import local_piece, piece_indices

    ids = torch.arange(10).view(1, 10) + 100
    mb = {"input_ids": ids, "labels": ids + 1, "position_ids": torch.arange(10).view(1, 10),
          "segment_ids": torch.zeros(1, 10, dtype=torch.long), "num_trained_tokens": 10}
    weights = torch.arange(10, dtype=torch.float64).view(1, 10) / 10
    pieces = piece_indices(12, 2, "ring")  # 10 tokens padded to 12 = 2·cp·3
    for rank in range(2):
        piece, w = local_piece(mb, rank, 2, weights, "ring")
        index = pieces[rank]
        real = index < 10
        assert torch.equal(piece["position_ids"][0], index)  # padding continues the positions
        assert torch.equal(piece["input_ids"][0][real], index[real] + 100)
        assert torch.equal(piece["labels"][0][real], index[real] + 101)
        assert bool((piece["labels"][0][~real] == -100).all()) and bool((w[0][~real] == 0).all())
        assert torch.equal(w[0][real], index[real].double() / 10)
        assert piece["num_trained_tokens"] == 10
