"""Run by test_regions.py: `regions_worker.py PHASE WORKDIR` under torchrun (gloo, CPU), or imported in-process.

Phases: `regions` (4 processes) checks every rank's box against what DTensor itself holds; `load-save`
(2 or 4 processes) loads checkpoints into each layout of that world size, checks every tensor against
the reference and saves them again; `hf` (2 processes) loads a Hugging Face directory into a TP model.
A tiny module with sizes that split unevenly (7 and 5 over 2 ranks) stands in for a model: a
column-parallel Linear, a row-parallel Linear and a replicated norm.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from isotrain.checkpoint.load import CheckpointReader, load_hf_weights, load_model, load_optimizer
from isotrain.checkpoint.save import SaveRequest, save
from isotrain.checkpoint.state import assign_owners, collect_items
from isotrain.models.unwrap import model_tensors
from isotrain.parallel.boxes import box_index, full_box, shard_spec
from isotrain.parallel.dist import shutdown_distributed

LAYOUTS = {1: ["single"], 2: ["tp2", "fsdp2"], 4: ["fsdp2xtp2"]}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def parallelise(model: nn.Module, layout: str) -> nn.Module:
    """Apply a layout: TP (column then row parallel, the norm replicated on the tp axis), then FSDP2."""
    if layout == "single":
        return model
    shape, names = {"tp2": ((2,), ("tp",)), "fsdp2": ((2,), ("dp_shard",)),
                    "fsdp2xtp2": ((2, 2), ("dp_shard", "tp"))}[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        tp = mesh["tp"]
        parallelize_module(model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for name, param in list(model.norm.named_parameters()):
            setattr(model.norm, name, nn.Parameter(distribute_tensor(param.data, tp, [Replicate()])))
    if "dp_shard" in names:
        fully_shard(model, mesh=mesh["dp_shard"])
    return model


def reference_step(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The single-process model after one AdamW step: every tensor a checkpoint holds is non-trivial."""
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def state_of(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, whole (gathered by DTensor itself), by checkpoint name."""
    out = {}
    for name, param in model_tensors(model).items():
        out[name] = full(param).detach().clone()
        for key, value in optimizer.state[param].items():
            out[f"{key}.{name}"] = full(value).detach().clone()
    return out


def save_as(root: Path, name: str, model, optimizer, rank: int, world: int) -> None:
    items = collect_items(model, optimizer, torch.float32)
    assign_owners(items, world)
    request = SaveRequest(1, items, rank_files={}, info={"kind": "test"})
    save(root, request, rank, dist.group.WORLD if world > 1 else None, run_id="test", name=name)


def load_into(directory: Path, layout: str, rank: int):
    model = parallelise(Tiny(), layout)  # its own random weights: the load must replace every one
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    reader = CheckpointReader(directory)
    try:
        load_model(reader, model, rank)
        load_optimizer(reader, model, optimizer, rank)
    finally:
        reader.close()
    return model, optimizer


def check_box(tensor: DTensor, whole: torch.Tensor, rank: int, world: int) -> None:
    """This rank's box is what DTensor holds here, and every rank computes the same boxes for all ranks."""
    spec = shard_spec(tensor)
    mine = spec.box(rank) if spec is not None else full_box(tuple(whole.shape))
    assert torch.equal(tensor.to_local(), whole[box_index(mine)]), (tensor.placements, mine)
    assert torch.equal(tensor.full_tensor(), whole)
    seen = [None] * world
    dist.all_gather_object(seen, mine)
    if spec is not None:
        assert seen == [spec.box(r) for r in range(world)], (tensor.placements, seen)
    else:
        assert all(box == mine for box in seen)


def phase_regions(rank: int, world: int) -> None:
    torch.manual_seed(0)
    whole, cube = torch.randn(7, 5), torch.randn(3, 7, 5)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    for placement in (Shard(0), Shard(1), Replicate()):  # a 1-D mesh of 2 (repeated over dp_shard)
        check_box(distribute_tensor(whole, mesh["tp"], [placement]), whole, rank, world)
    for placements in ((Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Shard(1))):
        check_box(distribute_tensor(whole, mesh, list(placements)), whole, rank, world)
    for placements in ((Shard(0), Shard(1)), (Shard(2), Shard(1))):  # 3-D, e.g. experts [E, out, in]
        check_box(distribute_tensor(cube, mesh, list(placements)), cube, rank, world)
    # What FSDP2 over TP really holds: compared with the weights before parallelising.
    model = Tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    parallelise(model, "fsdp2xtp2")
    kinds = set()
    for name, param in model.named_parameters():
        kinds.add(tuple(type(p).__name__ for p in param.placements))
        check_box(param, before[name], rank, world)
    assert ("_StridedShard", "Shard") in kinds, kinds  # the column-parallel weight, sharded twice on dim 0


def phase_load_save(root: Path, sources: list[str], rank: int, world: int) -> None:
    """Load each source into each layout of this world size, check, save as `<layout>-from-<source>`."""
    expected = torch.load(root / "reference.pt")
    for layout in LAYOUTS[world]:
        for source in sources:
            model, optimizer = load_into(root / source, layout, rank)
            got = state_of(model, optimizer)
            assert got.keys() == expected.keys(), (layout, source, sorted(got))
            for key, value in expected.items():
                assert torch.equal(got[key], value), (layout, source, key)
            save_as(root, f"{layout}-from-{source}", model, optimizer, rank, world)


def tp_llama(directory: Path) -> nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(1)  # weights unlike the saved ones
    model = LlamaForCausalLM(AutoConfig.from_pretrained(directory))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(len(model.model.layers)):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{proj}"] = ColwiseParallel()
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{proj}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def phase_hf(directory: Path, rank: int) -> None:
    from safetensors.torch import load_file

    saved = load_file(directory / "model.safetensors")
    model = tp_llama(directory)
    load_hf_weights(directory, model, rank)
    num_sharded = 0
    for name, tensor in model_tensors(model).items():
        expected = saved[name]
        if isinstance(tensor, DTensor) and isinstance(tensor.placements[0], Shard):
            # torch.chunk along the sharded dim, independently of the checkpoint's own box arithmetic.
            expected = expected.chunk(2, dim=tensor.placements[0].dim)[rank]
            num_sharded += 1
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        assert torch.equal(local.detach(), expected), name
    assert num_sharded == 14, num_sharded  # 7 projections in each of 2 layers


def main() -> None:
    """argv: comma-separated phases, the work directory, and for load-save the comma-separated sources."""
    phases, workdir = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for phase in phases:
            if phase == "regions":
                phase_regions(rank, world)
            elif phase == "load-save":
                phase_load_save(workdir, sys.argv[3].split(","), rank, world)
            elif phase == "hf":
                phase_hf(workdir / "hf", rank)
            else:
                raise ValueError(phase)
    finally:
        # A barrier on a normal exit, then the meshes are collected before their groups are destroyed: gloo's
        # threads torn down during interpreter finalisation abort the process.
        shutdown_distributed()


if __name__ == "__main__":
    main()
