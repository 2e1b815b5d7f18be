"""The plain causal LM's weights by Hugging Face name, one tensor at a time: what the trainer sends to a
rollout engine, and what the model files of a LoRA run's checkpoint hold.

Whatever wraps the trainer's model (DDP, FSDP2 shards, a peft LoRA model), the engine receives
the weights of the equivalent *plain* Hugging Face model: full logical shapes, fp32, CPU, under
the names `AutoModelForCausalLM.from_config(config).named_parameters()` would give. For LoRA
that is the merged weight

    W' = W + sum over active adapters a of  scaling_a * B_a @ A_a      (transposed for fan_in_fan_out)

computed on copies, so the trainer's model is never modified.

The tensors are yielded one by one so that no process ever needs a second copy of the whole
model; FSDP2's `full_tensor()` is a collective, so every rank must consume the iterator to the
end, in the same order (it is deterministic: `named_parameters()` order).

`saved_named_tensors` gives the same weights under the keys `save_pretrained` writes, for an engine that
loads Hugging Face checkpoints (vLLM): a mixture-of-experts model's fused experts become one tensor per
expert and projection (models/expert_keys.py), and each expert's block is gathered on its own, broadcast
from the rank that holds it (expert parallelism, with or without TP; FSDP2 or HSDP, with or without TP), or
assembled from its pieces where experts are split on several mesh dimensions, so the largest tensor any rank
materialises is one expert's, never a layer's experts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from isotrain.models.expert_keys import Part, expert_format, saved_parts
from isotrain.parallel.boxes import box_index, is_empty, shard_spec
from isotrain.models.unwrap import hf_model

# Parameter names of a peft LoRA layer: `<module>.base_layer.<leaf>` holds the frozen weight,
# `<module>.lora_A.<adapter>.weight` / `lora_B` the adapters, merged into `<module>.<leaf>`.
_BASE_LAYER = ".base_layer."
_ADAPTER_MARKERS = (".lora_", ".original_module.")
_MODULES_TO_SAVE = ".modules_to_save."


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 hex of the bytes of the tensor as a contiguous fp32 CPU tensor (the one checksum definition)."""
    data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(memoryview(data.numpy()).cast("B")).hexdigest()


def checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: tensor_sha256(tensor)}, e.g. of `sync_named_tensors(model)` to compare with an engine's."""
    return {name: tensor_sha256(tensor) for name, tensor in named_tensors}


def full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 CPU copy of the full logical tensor; gathers a DTensor (collective)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    # copy=True: the caller owns the result (it may be moved into shared memory or freed) and
    # must never alias a trainer parameter.
    return tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)


def sync_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain causal LM's parameters by Hugging Face name, full logical shape, fp32, CPU.

    Unwraps DDP (`.module`), gathers FSDP2 DTensors with `.full_tensor()` (a collective: every
    rank must iterate to the end, in the same order), and for a peft LoRA model yields the
    merged weights W + scale * B @ A under the base names (no `base_model.model.` prefix, no
    lora_* tensors) without modifying the trainer's model. Tied weights appear once, under the
    first name (`named_parameters()` de-duplicates them).
    """
    yield from _plain_tensors(model, gather=True)


def saved_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`sync_named_tensors` under the keys `save_pretrained` writes (full shapes, fp32, CPU): a MoE model's fused
    experts as `<layer>.mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight` (each family's names, global expert
    ids), expert by expert, each expert's block gathered alone. A collective like sync_named_tensors."""
    fmt = expert_format(getattr(hf_model(model), "config", None))
    for name, tensor in _plain_tensors(model, gather=False):
        parts = saved_parts(name, tuple(tensor.shape), fmt)
        if parts[0].expert is None:  # a tensor saved whole (under its family's name)
            yield parts[0].key, full_cpu(tensor)
        else:
            yield from _expert_parts(tensor, parts)


def _expert_parts(tensor: torch.Tensor, parts: list[Part]) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert parts of a fused expert tensor [E, ...], in order; one expert's block [...] at a time."""
    block_of = _expert_blocks(tensor)
    expert, block = None, None
    for part in parts:
        if part.expert != expert:
            expert, block = part.expert, block_of(part.expert)
        rows = tuple(slice(start, stop) for start, stop in part.box[1:])
        yield part.key, block[rows].clone()


def _expert_blocks(tensor: torch.Tensor):
    """A function e -> tensor[e] as a fresh fp32 CPU tensor; a collective over the DTensor's mesh.

    A DTensor sharded over its experts (dim 0) on one mesh dimension and replicated on the others (expert
    parallelism, with or without TP; FSDP2 without EP, with or without TP; HSDP) sends expert e from its owner, the
    rank holding block e // ceil(E / size) of torch.chunk's split, to the group of that mesh dimension: a broadcast of
    one expert. Any other placements (several sharded mesh dimensions, a sharded dim other than 0) assemble expert e
    from its pieces (`_assembled_block`), one expert at a time too."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return lambda e: tensor[e].detach().to(device="cpu", dtype=torch.float32, copy=True)
    sharded = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    local = tensor.to_local()
    if not sharded:
        return lambda e: local[e].detach().to(device="cpu", dtype=torch.float32, copy=True)
    placement = placements[sharded[0]]
    if len(sharded) > 1 or type(placement) is not Shard or placement.dim != 0:  # (not _StridedShard either)
        return lambda e: _assembled_block(tensor, e)
    mesh_dim = sharded[0]
    group, rank = tensor.device_mesh.get_group(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
    per_rank = -(-tensor.shape[0] // dist.get_world_size(group))  # torch.chunk's block size

    def block(e: int) -> torch.Tensor:
        owner, offset = divmod(e, per_rank)
        if owner == rank:
            rows = local[offset].detach().clone()
        else:
            rows = torch.empty(tuple(tensor.shape[1:]), dtype=local.dtype, device=local.device)
        dist.broadcast(rows, src=dist.get_global_rank(group, owner), group=group)
        return rows.to(device="cpu", dtype=torch.float32)

    return block


def _assembled_block(tensor, e: int) -> torch.Tensor:
    """Expert e of a DTensor of any placements, assembled from the pieces its ranks hold; memory: one expert's block.

    Every rank writes its own piece of expert e (its box of the full tensor, parallel/boxes.py, cut at row e) into a
    block of zero bits, then the block is summed over each sharded mesh dimension in turn, as int32 bit patterns:
    the pieces of the ranks along a sharded dimension are disjoint, so the integer sum of their bits is exactly
    their union (a float sum would turn -0.0 into 0.0), and ranks along a replicated dimension already hold the
    same block, so they are never summed."""
    mesh, placements = tensor.device_mesh, tensor.placements
    box = shard_spec(tensor).box(dist.get_rank())
    block = torch.zeros(tuple(tensor.shape[1:]), dtype=torch.float32, device=tensor.to_local().device)
    (start, stop), rest = box[0], box[1:]
    if start <= e < stop and not is_empty(box):
        block[box_index(rest)] = tensor.to_local()[e - start].detach().to(torch.float32)
    bits = block.view(torch.int32)
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_replicate():
            dist.all_reduce(bits, group=mesh.get_group(mesh_dim))
    return block.to(device="cpu", copy=True)


def _plain_tensors(model: nn.Module, gather: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """sync_named_tensors' names and tensors; with gather=False a plain parameter is yielded as it is (a DTensor
    stays sharded, for the caller to gather), merged LoRA weights are always full."""
    model = hf_model(model)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if any(marker in name for marker in _ADAPTER_MARKERS):
            continue  # adapters are merged into their base weight; original_module is shadowed
        if _BASE_LAYER in name:
            module_name, _, leaf = name.rpartition(_BASE_LAYER)
            yield f"{module_name}.{leaf}", _merged(modules[module_name], leaf, full_cpu(param))
        elif _MODULES_TO_SAVE in name:
            module_name, _, rest = name.partition(_MODULES_TO_SAVE)
            adapter, _, leaf = rest.partition(".")
            if adapter in _active_adapters(modules[module_name]):
                yield f"{module_name}.{leaf}", full_cpu(param)
        else:
            yield name, full_cpu(param) if gather else param


def _active_adapters(layer: nn.Module) -> list[str]:
    active = layer.active_adapters if hasattr(layer, "active_adapters") else []
    return [active] if isinstance(active, str) else list(active)


def _merged(layer: nn.Module, leaf: str, base: torch.Tensor) -> torch.Tensor:
    """`base` (the frozen weight or bias of a LoRA layer) plus the deltas its forward adds."""
    if getattr(layer, "disable_adapters", False):
        if getattr(layer, "merged", False):
            raise NotImplementedError(f"{layer.__class__.__name__} has merged but disabled adapters; unmerge first")
        return base  # disabled adapters: the forward is the base layer alone
    lora_a = getattr(layer, "lora_A", None)
    if lora_a is None:
        raise NotImplementedError(f"weight sync supports LoRA on linear layers only, not {layer.__class__.__name__}")
    merged_already = set(getattr(layer, "merged_adapters", []))
    for adapter in _active_adapters(layer):
        if adapter not in lora_a or adapter in merged_already:
            continue  # not on this layer, or already inside the base weight
        if adapter in getattr(layer, "lora_variant", {}):
            raise NotImplementedError(f"weight sync supports plain LoRA only, not the variant of adapter {adapter!r}")
        scaling = layer.scaling[adapter]
        if leaf == "weight":
            delta = full_cpu(layer.lora_B[adapter].weight) @ full_cpu(lora_a[adapter].weight)
            base = base + scaling * (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
        elif leaf == "bias" and layer.lora_bias.get(adapter, False):
            base = base + scaling * full_cpu(layer.lora_B[adapter].bias)
    return base
