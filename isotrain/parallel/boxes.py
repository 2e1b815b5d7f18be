"""Each rank's block of a DTensor: the geometry that loading, initialising and checkpointing share.

A tensor is either held whole by every rank (single process, DDP, replicated DTensors) or a DTensor
split over mesh axes by FSDP2, TP, EP or several of them; `shard_spec` gives every rank's block
(`Box`) of it, so any rank can find the part of any other. It lives in parallel/ because it is a
fact about placements only: models/build.py fills a rank's block when it initialises or loads a
model, and the checkpoint engine reads and writes the same blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

_SHARDS = (Shard, _StridedShard)  # FSDP2 over TP marks the dim it shards again as _StridedShard, not a Shard


Box = tuple[tuple[int, int], ...]  # [start, stop) along each tensor dim: a block of the full tensor


@dataclass(frozen=True)
class ShardSpec:
    """Which block of the full tensor each global rank holds, for a DTensor of any placements.

    Every placement (Shard(d) on any dim, Replicate, FSDP2's `_StridedShard`, several mesh axes)
    leaves each rank one box of the full tensor; ranks that differ only along replicated axes hold
    the same box. Boxes are listed once each, sorted by their offsets (for row blocks: file order).
    """

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]  # each distinct box once, sorted
    box_of_rank: tuple[int, ...]  # global rank -> index into `boxes`
    holders: tuple[int, ...]  # box index -> the first (lowest) rank holding it

    @functools.cached_property  # asked by every save of the tensor; a world of boxes to look through
    def row_blocks(self) -> bool:
        """Whether the boxes differ only along dim 0 and span every trailing dim: then each is one run of
        the file's bytes, written in place and read with one pread."""
        return all(is_empty(box) or box[1:] == tuple((0, n) for n in self.shape[1:]) for box in self.boxes)

    def box(self, rank: int) -> Box:
        return self.boxes[self.box_of_rank[rank]]

    def sends(self, rank: int, owner: int) -> bool:
        """Whether `rank` sends its box to `owner`: it is that box's first holder, the owner holds
        another box, and the box is not empty."""
        mine = self.box_of_rank[rank]
        return (rank != owner and self.holders[mine] == rank and mine != self.box_of_rank[owner]
                and not is_empty(self.boxes[mine]))


def is_empty(box: Box) -> bool:
    return any(stop <= start for start, stop in box)


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """Each rank's box of a DTensor; None for a plain tensor or one every rank holds whole."""
    if not isinstance(tensor, DTensor):
        return None
    return _spec(tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape))


@functools.cache
def _spec(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> ShardSpec | None:
    """Cached per (mesh, placements, shape): a model has few distinct ones, and this runs for every
    tensor of every save inside an async save's blocking part."""
    if any(not isinstance(p, (*_SHARDS, Replicate)) for p in placements):
        raise NotImplementedError(f"checkpointing cannot store a tensor with placements {placements}")
    if not any(isinstance(p, _SHARDS) for p in placements):
        return None  # replicated on every mesh axis: every rank holds it whole
    box_at: dict[tuple[int, ...], Box] = {}
    rank_boxes = []
    for coordinate in _coordinates(mesh):
        if coordinate not in box_at:
            box_at[coordinate] = _box(shape, tuple(mesh.shape), coordinate, placements)
        rank_boxes.append(box_at[coordinate])
    boxes = tuple(sorted(set(rank_boxes)))
    index = {box: i for i, box in enumerate(boxes)}
    box_of_rank = tuple(index[box] for box in rank_boxes)
    holders = tuple(box_of_rank.index(i) for i in range(len(boxes)))
    return ShardSpec(shape, boxes, box_of_rank, holders)


def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
         placements: tuple[Placement, ...]) -> Box:
    """The block of the full tensor that the rank at `coordinate` holds.

    torch's own split (the one `compute_local_shape_and_global_offset` applies, mesh axes left to
    right, `_StridedShard` undoing FSDP2-over-TP's right-to-left order) gives the global index of every
    local element along each dim; a checkpoint needs them to be one run per dim.
    """
    indices: dict[int, torch.Tensor] = {}
    sizes = list(shape)
    for axis, placement in enumerate(placements):
        if not isinstance(placement, _SHARDS):
            continue
        dim = placement.dim
        sizes[dim], indices[dim] = _get_shard_size_and_offsets(
            sizes[dim], mesh_shape[axis], coordinate[axis], placement, indices.get(dim), shape[dim], False)
    box = []
    for dim, size in enumerate(shape):
        if dim not in indices:
            box.append((0, size))
            continue
        if sizes[dim] == 0:
            box.append((0, 0))
            continue
        index = indices[dim]
        start = int(index[0])
        if not torch.equal(index, torch.arange(start, start + sizes[dim])):
            raise NotImplementedError(f"checkpointing needs each rank's part of a tensor to be one block, but "
                                      f"placements {placements} give dim {dim} of shape {list(shape)} a strided part")
        box.append((start, start + sizes[dim]))
    return tuple(box)


@functools.cache
def _coordinates(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Each global rank's coordinate in `mesh` (cached: reading the mesh costs ~0.1 ms per call).

    A submesh (the tp axis of a larger mesh) repeats over the other axes: every global rank sits in
    one copy, at the same coordinate as its peers of the other copies, so every rank computes the
    same boxes for all ranks whichever copy it is in.
    """
    copies = mesh._layout.remap_to_tensor(mesh._rank_map)  # [number of copies, *mesh.shape]
    coordinate = {}
    for index in np.ndindex(*copies.shape):
        coordinate[int(copies[index])] = index[1:]
    if sorted(coordinate) != list(range(len(coordinate))):
        raise NotImplementedError("checkpointing needs every mesh of a sharded tensor to span every rank")
    return tuple(coordinate[r] for r in range(len(coordinate)))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
