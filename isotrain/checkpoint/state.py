"""What a checkpoint holds, as a flat list of named tensors plus small JSON-able state.

Every tensor is named by its logical identity, never by rank or layout: model weights by their
Hugging Face name, optimizer state as `exp_avg.<name>`, `exp_avg_sq.<name>`, `step.<name>` and (for
bf16 model files) `master.<name>` in full logical shape (invariant 6). A tensor is either held whole
by every rank (single process, DDP, replicated DTensors) or a DTensor split over mesh axes by FSDP2, TP
or both; `ShardSpec` (parallel/boxes.py) gives every rank's block of it, so any rank can find the part of any other.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from isotrain.errors import CheckpointError
from isotrain.models.expert_keys import Part, expert_format, is_fused, saved_parts
from isotrain.models.unwrap import hf_model, is_lora, model_tensors
from isotrain.models.weights import sync_named_tensors
from isotrain.parallel.boxes import Box, ShardSpec, full_box, is_empty, local_part, shard_spec
from isotrain.parallel.dims import num_experts

OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")












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
    holders: tuple[int, ...] | None = None  # the ranks that hold it (a pipeline stage's); None: any rank

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def saved_by(self, rank: int) -> bool:
        """Whether `rank` takes part in saving this item: it writes it, or sends its box to the owner."""
        return rank == self.owner or (self.shard is not None and self.shard.sends(rank, self.owner))












def model_parts(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, list[Part]]:
    """The saved tensors of each in-memory tensor: itself under its name, or, for the fused experts of a MoE
    family, one tensor per expert and projection under the keys `save_pretrained` writes (expert_keys.py)."""
    config = getattr(hf_model(model), "config", None)
    fmt = expert_format(config)
    tensors = model_tensors(model) if tensors is None else tensors
    if fmt is not None and num_experts(config) is not None:
        for name, t in tensors.items():
            if is_fused(name, tuple(t.shape)) and t.shape[0] != num_experts(config):
                # Expert ids are global dim-0 indices: a rank's local slice would be numbered from 0 again.
                raise CheckpointError(f"{name} holds {t.shape[0]} experts but the model has {num_experts(config)}; "
                                      "experts split over ranks must be DTensors (Shard(0) over their global ids) so "
                                      "that checkpoints store every expert under its global id")
    return {name: saved_parts(name, tuple(t.shape), fmt) for name, t in tensors.items()}


def is_whole(parts: list[Part], shape: tuple[int, ...]) -> bool:
    """Whether a tensor is saved as it is in memory (one part, the full box)."""
    return len(parts) == 1 and not parts[0].drop_first and parts[0].box == full_box(tuple(shape))


def within(box: Box, part: Part) -> Box:
    """The block of `part`'s saved tensor that lies inside `box` (a block of the in-memory tensor), in the
    saved tensor's own coordinates; all dims empty when the two do not meet."""
    meet = tuple((max(a, c) - c, min(b, d) - c) for (a, b), (c, d) in zip(box, part.box))
    if is_empty(meet):
        return tuple((0, 0) for _ in part.shape)
    return meet[1:] if part.drop_first else meet


def part_view(local: torch.Tensor, own: Box, part: Part) -> torch.Tensor:
    """The block of `part` that this rank holds, as a view of its local tensor `local` (block `own` of the
    in-memory tensor); an empty tensor when it holds none of it."""
    meet = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(own, part.box)]
    if any(stop <= start for start, stop in meet):
        return local.new_empty([0] * len(part.shape))
    view = local[tuple(slice(start - first, stop - first) for (start, stop), (first, _) in zip(meet, own))]
    return view[0] if part.drop_first else view


def part_spec(spec: ShardSpec | None, part: Part) -> ShardSpec | None:
    """Each rank's block of the saved tensor `part` of a tensor laid out as `spec`.

    Generic over placements: an expert's tensor is held by the ranks whose box of the fused tensor contains
    its rows, whether dim 0 is split by FSDP2 or by expert parallelism (`Shard(0)` over the experts), and
    split further if another mesh axis cuts its other dims (TP).
    """
    return None if spec is None else _part_spec(spec, part.box, part.drop_first)


@functools.cache
def _part_spec(spec: ShardSpec, box: Box, drop_first: bool) -> ShardSpec | None:
    """Cached by the part's block, not its name: every layer's expert e shares one (a large MoE model has
    tens of thousands of expert tensors, and this runs for each of them inside an async save's blocking part)."""
    part = Part("", box, drop_first)
    rank_boxes = [within(spec.boxes[i], part) for i in spec.box_of_rank]
    if all(box == full_box(part.shape) for box in rank_boxes):
        return None  # every rank holds the whole part
    boxes = tuple(sorted(set(rank_boxes)))
    index = {box: i for i, box in enumerate(boxes)}
    box_of_rank = tuple(index[box] for box in rank_boxes)
    holders = tuple(box_of_rank.index(i) for i in range(len(boxes)))
    return ShardSpec(part.shape, boxes, box_of_rank, holders)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def part_items(prefix: str, kind: str, tensor: torch.Tensor, parts: list[Part], dtype: torch.dtype) -> list[Item]:
    """One item per saved part of `tensor` (a plain tensor or DTensor), named `prefix + part.key`: a view of
    this rank's block of it and every rank's block (`part_spec`), so that it is saved like any tensor."""
    spec, local = shard_spec(tensor), local_part(tensor).detach()
    if is_whole(parts, tuple(tensor.shape)):
        return [Item(prefix + parts[0].key, kind, tuple(tensor.shape), dtype, local, spec)]
    own = spec.box(_rank()) if spec is not None else full_box(tuple(tensor.shape))
    return [Item(prefix + part.key, kind, part.shape, dtype, part_view(local, own, part), part_spec(spec, part))
            for part in parts]


def _lora_items(model: nn.Module, params: dict[str, torch.Tensor], save_dtype: torch.dtype) -> list[Item]:
    """A LoRA model's files hold the merged weights W + scale·B@A under Hugging Face names, so the
    directory loads in transformers as the trained policy (invariant 6); the adapters themselves,
    which resume needs, go to train_state as `adapter.<peft name>` beside their optimizer state."""
    fmt = expert_format(getattr(hf_model(model), "config", None))
    items = [item for name, t in sync_named_tensors(model)
             for item in part_items("", "model", t, saved_parts(name, tuple(t.shape), fmt),
                                    save_dtype if t.is_floating_point() else t.dtype)]
    items += [Item(f"adapter.{name}", "optimizer", tuple(t.shape), t.dtype, local_part(t).detach(), shard_spec(t))
              for name, t in params.items() if t.requires_grad]
    return items


def collect_items(model: nn.Module, optimizer: torch.optim.Optimizer, save_dtype: torch.dtype) -> list[Item]:
    """Every tensor of model and optimizer state, in a fixed order that every rank shares.

    Model tensors and their optimizer state are named by the saved keys (`model_parts`): a MoE model's
    experts are saved one tensor per expert under its global id, their moments under the same names."""
    params = model_tensors(model)
    lora = is_lora(model)
    if lora:
        items = _lora_items(model, params, save_dtype)
        parts = None
    else:
        parts = model_parts(model, params)
        items = [item for name, t in params.items()
                 for item in part_items("", "model", t, parts[name], save_dtype if t.is_floating_point() else t.dtype)]
    # LoRA adapters are trained and stored in fp32 already: they need no master copies.
    items += _optimizer_items(optimizer, params, "", master=save_dtype != torch.float32 and not lora, parts=parts)
    return items


def _optimizer_items(optimizer, params: dict[str, torch.Tensor], prefix: str, master: bool,
                     parts: dict[str, list[Part]] | None = None) -> list[Item]:
    """AdamW state per saved tensor as `<key>.<prefix><saved key>` (and fp32 masters `master.<prefix><saved key>`);
    without `parts`, every parameter is saved whole under its name. An expert's `step` is stored once per part."""
    items = []
    names = {id(p): n for n, p in params.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[id(param)]
            its = parts[name] if parts is not None else [Part(name, full_box(tuple(param.shape)))]
            state = optimizer.state.get(param, {})
            if master and param.is_floating_point():
                items += part_items(f"master.{prefix}", "optimizer", param, its, param.dtype)
            for key in OPTIMIZER_STATE_KEYS:
                if key not in state:
                    continue
                value = state[key]
                if key == "step":
                    items += [Item(f"step.{prefix}{part.key}", "optimizer", tuple(value.shape), value.dtype,
                                   local_part(value).detach(), shard_spec(value)) for part in its]
                else:
                    items += part_items(f"{key}.{prefix}", "optimizer", value, its, value.dtype)
    return items


def component_items(prefix: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Item]:
    """Another trained model of the run (PPO's critic): whole in train_state, in fp32, as `<prefix>.<name>`,
    with its optimizer state as `<key>.<prefix>.<name>` — layout-free like the policy's."""
    params = model_tensors(model)
    items = [Item(f"{prefix}.{name}", "optimizer", tuple(t.shape), t.dtype, local_part(t).detach(), shard_spec(t))
             for name, t in params.items()]
    return items + _optimizer_items(optimizer, params, f"{prefix}.", master=False)


def pipeline_items(items: list[Item], group, shared: frozenset[str] = frozenset()) -> list[Item]:
    """Under pipeline parallelism each rank holds its stage's tensors only, under the full model's names: every
    stage's items, stage after stage (one order all ranks share), each held, and so written, by the ranks of its own
    stage alone; another stage's item is a name, a shape and a dtype here (`local` is never read on a rank that does
    not hold it). With data parallelism beside the pipeline, a stage's DP ranks hold its tensors whole (DDP) or in
    boxes (FSDP2), and the other stages' ranks hold an empty box of them (`_within`). The files and their index are
    then those of one process. `group`: every rank of the run. `shared`: the model tensors of this stage that another holds copies of
    (a tied embedding, on the first and last stage: parallel/pp.py), each held by both stages' ranks, written once
    from either copy, with its optimizer state."""
    mine = [(item.key, item.kind, item.shape, item.dtype, item.shard) for item in items]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dist.get_rank(), mine, sorted(shared)), group=group)
    shared = frozenset(name for _, _, names in gathered for name in names)  # (the stages in between hold none)
    own = {item.key: item for item in items}
    described, ranks = {}, {}
    for rank, listed, _ in sorted(gathered, key=lambda entry: entry[0]):
        for key, kind, shape, dtype, shard in listed:
            described.setdefault(key, (kind, shape, dtype, shard))
            ranks.setdefault(key, []).append(rank)
    merged = []
    for key, (kind, shape, dtype, shard) in described.items():
        item = own.get(key) or Item(key, kind, shape, dtype, torch.empty(0, dtype=dtype))
        item.holders = tuple(ranks[key])
        if shard is not None:
            item.shard = _within(shard, item.holders)
        merged.append(item)
    # Each stage's ranks hold all of its tensors and none of another's, so the sets of holders are disjoint; a
    # tensor that two stages hold has the union of theirs.
    by_holders: dict[tuple[int, ...], list[str]] = {}
    for item in merged:
        by_holders.setdefault(item.holders, []).append(item.key)
    for a in by_holders:
        for b in by_holders:
            if len(a) > len(b) and set(a) & set(b) and not all(_of_shared(key, shared) for key in by_holders[a]):
                raise CheckpointError(f"two pipeline stages hold {by_holders[a][0]!r}; each tensor must belong to one "
                                      "stage (only a tied embedding's copies are held by two)")
    return merged


def other_stage_keys(model: nn.Module, group) -> frozenset[str]:
    """The saved keys of the model tensors that the other pipeline stages hold, gathered over `group` (every rank of
    the run): what a strict load may find in a checkpoint besides this stage's own. A MoE model's experts are saved
    one key per expert (`model_parts`), not under their fused in-memory name."""
    own = sorted(part.key for parts in model_parts(model).values() for part in parts)
    keys = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, own, group=group)
    return frozenset(key for rank in keys for key in rank) - set(own)


def _of_shared(key: str, shared: frozenset[str]) -> bool:
    """Whether a checkpoint key is one of the `shared` model tensors or its optimizer state (`exp_avg.<name>`, ...)."""
    return key in shared or key.partition(".")[2] in shared


def _within(spec: ShardSpec, ranks: tuple[int, ...]) -> ShardSpec:
    """`spec` (the boxes of a DTensor on a mesh of the stage's DP ranks, repeated over every stage's copy of that
    mesh) with an empty box on the ranks outside `ranks`: they do not hold the tensor."""
    empty = tuple((0, 0) for _ in spec.shape)
    rank_boxes = [spec.box(rank) if rank in ranks else empty for rank in range(len(spec.box_of_rank))]
    boxes = tuple(sorted(set(rank_boxes)))
    box_of_rank = tuple(boxes.index(box) for box in rank_boxes)
    return ShardSpec(spec.shape, boxes, box_of_rank, tuple(box_of_rank.index(i) for i in range(len(boxes))))


def _holders(item: Item, world_size: int) -> list[int]:
    """The ranks that hold all of `item`: those of its one non-empty box (an expert, a block held by a
    single shard), else every rank (the tensor travels to whichever owns it)."""
    if item.holders is not None:
        return list(item.holders)
    if item.shard is None:
        return list(range(world_size))
    filled = [i for i, box in enumerate(item.shard.boxes) if not is_empty(box)]
    if len(filled) != 1:
        return list(range(world_size))
    return [rank for rank, index in enumerate(item.shard.box_of_rank) if index == filled[0]]


def assign_owners(items: list[Item], world_size: int) -> None:
    """Balance the bytes each rank writes: largest tensors first, each to the least-loaded rank, among the
    ranks that hold it all when some do (each rank writes the experts it holds: no transfer).

    Model and optimizer tensors are balanced separately, so every rank writes a share of both.
    """
    for kind in ("model", "optimizer"):
        loads = [0] * world_size
        for item in sorted((i for i in items if i.kind == kind), key=lambda i: (-i.num_bytes, i.key)):
            owner = min(_holders(item, world_size), key=lambda rank: (loads[rank], rank))
            item.owner = owner
            loads[owner] += item.num_bytes


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
