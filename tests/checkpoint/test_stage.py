"""The copy an async save takes before the loop may change the state (isotrain/checkpoint/manager.py
`stage`): on any number of threads, every tensor this rank writes is copied exactly into a kept host
buffer, later changes to the live tensors do not reach it, and nothing else is copied."""

from __future__ import annotations

import pytest
import torch

from isotrain.checkpoint.manager import stage
from isotrain.checkpoint.state import Item
from isotrain.parallel.boxes import ShardSpec


def items(seed: int) -> list[Item]:
    """Whole tensors owned by rank 0 or 1 and shards of assorted sizes and dtypes."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for i, (shape, dtype) in enumerate([((300, 7), torch.float32), ((5,), torch.bfloat16), ((64, 64), torch.float32),
                                        ((1,), torch.int64), ((4097,), torch.float32), ((33, 3), torch.bfloat16)]):
        local = torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point else torch.tensor([7 + i])
        full = (2 * shape[0], *shape[1:])
        boxes = tuple(((k * shape[0], (k + 1) * shape[0]), *((0, n) for n in shape[1:])) for k in range(2))
        shard = ShardSpec(full, boxes, (0, 1), (0, 1)) if i % 3 == 2 else None
        made.append(Item(f"t{i}", "model", shape, dtype, local, shard, owner=i % 2))
    # Four ranks in two replicas of a two-way split (HSDP, or TP with data parallelism): rank 1 holds the
    # same box as rank 0, which sends it, so rank 1 copies nothing.
    replicated = ShardSpec((6, 2), (((0, 3), (0, 2)), ((3, 6), (0, 2))), (0, 0, 1, 1), (0, 2))
    made.append(Item("t6", "model", (6, 2), torch.float32, torch.randn((3, 2), generator=generator), replicated, 2))
    return made


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_staging_copies_exactly_what_this_rank_writes(threads):
    staged, live = items(seed=threads), items(seed=threads)
    buffers: dict[str, torch.Tensor] = {}
    originals = [item.local for item in staged]
    stage(staged, rank=1, buffers=buffers, threads=threads)
    for item, source, original in zip(staged, live, originals):
        if not item.saved_by(1):
            assert item.local is None, item.key
            continue
        assert item.local is buffers[item.key] and item.local.data_ptr() != original.data_ptr()
        assert torch.equal(item.local, source.local) and item.local.dtype == source.local.dtype, item.key
    assert sorted(buffers) == ["t1", "t2", "t3", "t5"]


def test_the_next_save_reuses_the_buffers_and_the_copy_stays_put():
    buffers: dict[str, torch.Tensor] = {}
    first = items(seed=0)
    sources = [item.local for item in first]
    stage(first, rank=0, buffers=buffers, threads=2)
    kept = {key: tensor.data_ptr() for key, tensor in buffers.items()}
    before = {item.key: item.local.clone() for item in first if item.local is not None}
    for source in sources:  # what the next optimizer step does to the live state
        source.add_(1)
    for item in first:
        if item.local is not None:
            assert torch.equal(item.local, before[item.key]), item.key
    second = items(seed=1)
    stage(second, rank=0, buffers=buffers, threads=2)
    assert {key: tensor.data_ptr() for key, tensor in buffers.items()} == kept
