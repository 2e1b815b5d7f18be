"""What a checkpoint holds, as a flat list of named tensors plus small JSON-able state.

Every tensor is named by its logical identity, never by rank or layout: model weights by their
Hugging Face name, optimizer state as `exp_avg.<name>`, `exp_avg_sq.<name>`, `step.<name>` and (for
bf16 model files) `master.<name>` in full logical shape (invariant 6). A tensor is either held whole
by every rank (single process, DDP, replicated DTensors) or a DTensor split over mesh axes by FSDP2, TP
or both; `ShardSpec` gives every rank's block of it, so any rank can find the part of any other.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

from isotrain.models.unwrap import is_lora, unwrap
from isotrain.models.weights import sync_named_tensors

OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
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
        return all(box[1:] == tuple((0, n) for n in self.shape[1:]) for box in self.boxes)

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


@dataclass
class Item:
    """One tensor of the checkpoint, as this rank sees it."""

    key: str
    kind: str  # "model" or "optimizer"
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype written to disk
    local: torch.Tensor  # this rank's whole tensor, or its box of it (`shard`)
    shard: ShardSpec | None = None
    owner: int = 0  # the rank that writes it

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def saved_by(self, rank: int) -> bool:
        """Whether `rank` takes part in saving this item: it writes it, or sends its box to the owner."""
        return rank == self.owner or (self.shard is not None and self.shard.sends(rank, self.owner))


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


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their Hugging Face names (tied weights once)."""
    base = unwrap(model)
    persistent = set(base.state_dict().keys())
    tensors = dict(base.named_parameters())
    tensors.update((name, buf) for name, buf in base.named_buffers() if name in persistent)
    return tensors


def _lora_items(model: nn.Module, params: dict[str, torch.Tensor], save_dtype: torch.dtype) -> list[Item]:
    """A LoRA model's files hold the merged weights W + scale·B@A under Hugging Face names, so the
    directory loads in transformers as the trained policy (invariant 6); the adapters themselves,
    which resume needs, go to train_state as `adapter.<peft name>` beside their optimizer state."""
    items = [Item(name, "model", tuple(t.shape), save_dtype if t.is_floating_point() else t.dtype, t, None)
             for name, t in sync_named_tensors(model)]
    items += [Item(f"adapter.{name}", "optimizer", tuple(t.shape), t.dtype, local_part(t).detach(), shard_spec(t))
              for name, t in params.items() if t.requires_grad]
    return items


def collect_items(model: nn.Module, optimizer: torch.optim.Optimizer, save_dtype: torch.dtype) -> list[Item]:
    """Every tensor of model and optimizer state, in a fixed order that every rank shares."""
    params = model_tensors(model)
    lora = is_lora(model)
    if lora:
        items = _lora_items(model, params, save_dtype)
    else:
        items = [Item(name, "model", tuple(t.shape), save_dtype if t.is_floating_point() else t.dtype,
                      local_part(t).detach(), shard_spec(t)) for name, t in params.items()]
    # LoRA adapters are trained and stored in fp32 already: they need no master copies.
    items += _optimizer_items(optimizer, params, "", master=save_dtype != torch.float32 and not lora)
    return items


def _optimizer_items(optimizer, params: dict[str, torch.Tensor], prefix: str, master: bool) -> list[Item]:
    """AdamW state per parameter as `<key>.<prefix><name>` (and fp32 masters `master.<prefix><name>`)."""
    items = []
    names = {id(p): n for n, p in params.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = prefix + names[id(param)]
            state = optimizer.state.get(param, {})
            if master and param.is_floating_point():
                items.append(Item(f"master.{name}", "optimizer", tuple(param.shape), param.dtype,
                                  local_part(param).detach(), shard_spec(param)))
            for key in OPTIMIZER_STATE_KEYS:
                if key in state:
                    value = state[key]
                    items.append(Item(f"{key}.{name}", "optimizer", tuple(value.shape), value.dtype,
                                      local_part(value).detach(), shard_spec(value)))
    return items


def component_items(prefix: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Item]:
    """Another trained model of the run (PPO's critic): whole in train_state, in fp32, as `<prefix>.<name>`,
    with its optimizer state as `<key>.<prefix>.<name>` — layout-free like the policy's."""
    params = model_tensors(model)
    items = [Item(f"{prefix}.{name}", "optimizer", tuple(t.shape), t.dtype, local_part(t).detach(), shard_spec(t))
             for name, t in params.items()]
    return items + _optimizer_items(optimizer, params, f"{prefix}.", master=False)


def assign_owners(items: list[Item], world_size: int) -> None:
    """Balance the bytes each rank writes: largest tensors first, each to the least-loaded rank.

    Model and optimizer tensors are balanced separately, so every rank writes a share of both.
    """
    for kind in ("model", "optimizer"):
        for rank, share in enumerate(balance([i for i in items if i.kind == kind], world_size)):
            for item in share:
                item.owner = rank


def balance(items: list[Item], bins: int) -> list[list[Item]]:
    """`items` in `bins` lists of similar bytes: largest first, each to the lightest list (the first on ties)."""
    shares: list[list[Item]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for item in sorted(items, key=lambda i: (-i.num_bytes, i.key)):
        lightest = min(range(bins), key=lambda b: (loads[b], b))
        shares[lightest].append(item)
        loads[lightest] += item.num_bytes
    return shares


def rng_state() -> dict:
    """Every RNG this process uses, as JSON-able values."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch_cpu": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])
