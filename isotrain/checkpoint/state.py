"""What a checkpoint holds, as a flat list of named tensors plus small JSON-able state.

Every tensor is named by its logical identity, never by rank or layout: model weights by their
Hugging Face name, optimizer state as `exp_avg.<name>`, `exp_avg_sq.<name>`, `step.<name>` and (for
bf16 model files) `master.<name>` in full logical shape (invariant 6). A tensor is either held whole
by every rank (single process, DDP) or sharded along dim 0 over an FSDP2 mesh axis (torch.chunk
rows); `ShardSpec` describes that split so any rank can find the rows of any other.
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
from torch.distributed.tensor import DTensor, Replicate, Shard

from isotrain.models.unwrap import is_lora, unwrap
from isotrain.models.weights import sync_named_tensors

OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class ShardSpec:
    """Rows [start(c), stop(c)) of dim 0 live on the ranks at coordinate c of one mesh axis."""

    num_shards: int
    shard_of_rank: tuple[int, ...]  # global rank -> its shard coordinate
    rows: int

    @property
    def chunk(self) -> int:  # torch.chunk: every shard but the last holds ceil(rows / num_shards)
        return -(-self.rows // self.num_shards)

    def bounds(self, shard: int) -> tuple[int, int]:
        start = min(shard * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)


@dataclass
class Item:
    """One tensor of the checkpoint, as this rank sees it."""

    key: str
    kind: str  # "model" or "optimizer"
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype written to disk
    local: torch.Tensor  # this rank's whole tensor, or its dim-0 shard
    shard: ShardSpec | None = None
    owner: int = 0  # the rank that writes it

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The dim-0 split of an FSDP2 parameter or optimizer state; None for a whole tensor."""
    if not isinstance(tensor, DTensor):
        return None
    mesh, placements = tensor.device_mesh, tensor.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0 or not all(
        isinstance(p, (Replicate, Shard)) for p in placements
    ):
        raise NotImplementedError(f"checkpointing supports Shard(0) placements only, not {placements}")
    return ShardSpec(mesh.size(shard_dims[0]), _shard_of_rank(mesh, shard_dims[0]), tensor.shape[0])


@functools.cache
def _shard_of_rank(mesh: DeviceMesh, axis: int) -> tuple[int, ...]:
    """Each global rank's coordinate along `axis` (cached: `mesh.mesh` costs ~0.1 ms per call, paid by
    every tensor of every save, inside an async save's blocking part)."""
    ranks = mesh.mesh  # global ranks laid out by mesh coordinates
    coordinate = {}
    for index in np.ndindex(*ranks.shape):
        coordinate[int(ranks[index])] = index[axis]
    if sorted(coordinate) != list(range(len(coordinate))):
        raise NotImplementedError("checkpointing needs the FSDP2 mesh to span every rank")
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
