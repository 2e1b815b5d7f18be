"""Run by test_moe_ep_layout.py: `ep_worker.py PHASE WORKDIR` under torchrun (gloo, CPU, 2 processes), or imported.

Experts as expert parallelism lays them out: the fused expert tensors of a tiny Qwen3-MoE model are DTensors
`Shard(0)` over a mesh axis named "ep" (each rank holds half the experts, global ids = global dim-0 index),
every other tensor whole on every rank. No MoE forward is run: every parameter gets a fixed seeded gradient and
one AdamW step, so weights and moments are non-trivial and known on one process.

Phases: `save` writes a checkpoint from that layout; `load` reads the single-process checkpoint into it and
checks each rank's experts against the reference, by torch.chunk, independently of the checkpoint's box code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM

from isotrain.checkpoint.load import CheckpointReader, load_model, load_optimizer
from isotrain.checkpoint.save import SaveRequest, save
from isotrain.checkpoint.state import assign_owners, collect_items
from isotrain.models.unwrap import model_tensors
from isotrain.parallel.dist import shutdown_distributed


def tiny_moe(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32)
    return AutoModelForCausalLM.from_config(config)


def is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def expert_parallel(model: nn.Module) -> nn.Module:
    """Fused experts as DTensors Shard(0) over the "ep" axis of a 2-rank mesh; the rest replicated plain tensors."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    for name, param in list(model.named_parameters()):
        if is_expert(name):
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, leaf, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))
    return model


def one_step(model: nn.Module) -> torch.optim.Optimizer:
    """A seeded gradient for every parameter (the same full tensor on every layout) and one AdamW step."""
    generator = torch.Generator().manual_seed(7)
    for name, param in model_tensors(model).items():
        grad = torch.randn(tuple(param.shape), generator=generator)
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements) if isinstance(param, DTensor) \
            else grad
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    optimizer.step()
    return optimizer


def save_as(root: Path, name: str, model, optimizer, rank: int, world: int) -> None:
    items = collect_items(model, optimizer, torch.float32)
    assign_owners(items, world)
    request = SaveRequest(1, items, rank_files={}, info={"kind": "test"})
    save(root, request, rank, dist.group.WORLD if world > 1 else None, run_id="test", name=name)


def reference() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_moe(0)
    return model, one_step(model)


def phase_save(root: Path, rank: int, world: int) -> None:
    model = expert_parallel(tiny_moe(0))
    optimizer = one_step(model)
    save_as(root, "ep2", model, optimizer, rank, world)


def phase_load(root: Path, rank: int) -> None:
    plain, plain_optimizer = reference()
    expected = dict(plain.named_parameters())
    model = expert_parallel(tiny_moe(1))  # other weights: the load must replace every one
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    reader = CheckpointReader(root / "single")
    try:
        load_model(reader, model, rank)
        load_optimizer(reader, model, optimizer, rank)
    finally:
        reader.close()
    num_sharded = 0
    for name, param in model_tensors(model).items():
        state, want_state = optimizer.state[param], plain_optimizer.state[expected[name]]
        for got, want in [(param, expected[name]), (state["exp_avg"], want_state["exp_avg"]),
                          (state["exp_avg_sq"], want_state["exp_avg_sq"])]:
            if isinstance(got, DTensor):
                got, want = got.to_local(), want.chunk(dist.get_world_size(), dim=0)[rank]
                num_sharded += 1
            assert torch.equal(got.detach(), want.detach()), name
        assert torch.equal(state["step"], want_state["step"]), name
    assert num_sharded == 3 * 4, num_sharded  # 2 fused tensors in each of 2 layers, weights and 2 moments


def main() -> None:
    phase, workdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if phase == "save":
            phase_save(workdir, rank, world)
        elif phase == "load":
            phase_load(workdir, rank)
        else:
            raise ValueError(phase)
    finally:
        # A barrier on a normal exit, then the meshes are collected before their groups are destroyed: gloo's
        # threads torn down during interpreter finalisation abort the process.
        shutdown_distributed()


if __name__ == "__main__":
    main()
