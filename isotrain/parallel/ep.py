"""Expert parallelism: each rank of an EP group holds 1/ep of every MoE layer's experts; tokens travel to them.

The fused expert weights of a transformers MoE layer (`mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]) become DTensors `Shard(0)` on the "ep" mesh axis: rank r of the group
holds experts r·E/ep … (r+1)·E/ep - 1, and the global expert id stays the global dim-0 index (checkpoints
see global ids). The router stays replicated and runs on each rank's own tokens as before; only the
experts' forward is replaced (`ExpertParallelExperts`):

    1. order this rank's (token, slot) pairs by expert id and count them per expert;
    2. exchange the counts (all_to_all_single, E/ep per rank): each rank learns how many rows it receives
       for each of its experts from each source rank;
    3. send the pairs' hidden states to the experts' owners (all_to_all_single with autograd, uneven splits);
    4. run each local expert on the rows it received (every source rank's rows for it at once);
    5. send the outputs back (the same all-to-all in reverse) and combine them as transformers does:
       Σ_slots weight(token, slot) · expert_output, added expert by expert in ascending expert id.

No token is dropped (no capacity factor). The backward of each all-to-all is the reverse all-to-all, so
an expert's gradient sums the contributions of every token routed to it on any rank of the group; the
gradients of ranks holding the same experts (DP size / ep "ep_replicate" copies, times cp under context
parallelism) are summed by `sync_expert_grads`, exactly like a data-parallel gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from isotrain.errors import ConfigError
from isotrain.parallel.dist import all_reduce_flat

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of every fused-experts module (transformers' `*Experts`: gate_up_proj and down_proj
    3-D parameters, one slice per expert)."""
    found = {}
    for name, module in model.named_modules():
        params = module._parameters
        if all(key in params and params[key] is not None and params[key].ndim == 3 for key in EXPERT_PARAMS):
            found[name] = module
    return found


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of `model` (empty without expert parallelism)."""
    return [module._parameters[key] for module in model.modules() if isinstance(module, ExpertParallelExperts)
            for key in EXPERT_PARAMS]


def _ep_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The "ep" dimension of the experts' mesh, which is ("ep", "tp") under tensor parallelism."""
    return mesh["ep"] if mesh.ndim > 1 else mesh


def _shard_rows(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """`param` as a DTensor on `mesh` ("ep", or ("ep", "tp") under tensor parallelism), Shard(0) over "ep" and
    replicated over "tp", this rank keeping its own block of experts (no communication: every rank holds the
    same full tensor, or a meta one; under TP a `Replicate` DTensor whose local part is that full tensor)."""
    full = param.to_local() if isinstance(param, DTensor) else param.data
    ep = _ep_mesh(mesh)
    size, rank = ep.size(), ep.get_local_rank()
    rows = full.shape[0] // size
    local = full[rank * rows:(rank + 1) * rows].clone()
    placements = (Shard(0), Replicate()) if mesh.ndim > 1 else (Shard(0),)
    sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


class ExpertParallelExperts(nn.Module):
    """A transformers fused-experts module whose experts live on the ranks of an EP group.

    Same parameter names and call signature as the module it replaces:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H].
    """

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        ep = _ep_mesh(mesh)
        self.num_experts = experts.gate_up_proj.shape[0]
        self.ep_size = ep.size()
        self.local_experts = self.num_experts // self.ep_size
        self.act_fn = experts.act_fn
        # Under TP the group is the EP ranks with this rank's TP coordinate: the TP ranks of an EP group all
        # hold the same tokens and dispatch them redundantly, each to its own TP coordinate's expert owners.
        self.group = ep.get_group()
        for key in EXPERT_PARAMS:
            self.register_parameter(key, _shard_rows(getattr(experts, key), mesh))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # Under FSDP2 with a compute dtype the hidden states arrive in it, but FSDP2 leaves the experts out:
        # cast them as it casts the parameters it manages (the gradient returns in the parameters' dtype).
        gate_up, down = (getattr(self, key).to_local().to(hidden_states.dtype) for key in EXPERT_PARAMS)
        return expert_parallel_forward(hidden_states, top_k_index, top_k_weights, gate_up, down, self.act_fn,
                                       self.group, self.num_experts)


def local_experts_forward(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                           act_fn) -> torch.Tensor:
    """Each local expert on its consecutive block of `rows` (counts[e] rows for expert e): transformers'
    gated MLP, down(act(gate(x)) · up(x)). Every expert runs, on zero rows if it received none, so its
    gradient is defined (zeros) on every rank and the replica sums line up."""
    outputs = []
    for e, block in enumerate(torch.split(rows, counts)):
        gate, up = nn.functional.linear(block, gate_up[e]).chunk(2, dim=-1)
        outputs.append(nn.functional.linear(act_fn(gate) * up, down[e]))
    return torch.cat(outputs)


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows to the ranks of `group` (input_splits[r] rows to rank r; output_splits[r] rows from it), with
    autograd: the backward sends the gradients back by the reverse all-to-all. Uneven splits; gloo works."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))


def expert_parallel_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, act_fn, group, num_experts: int) -> torch.Tensor:
    """The MoE experts' output for this rank's tokens, computed by the ranks of `group` that own the experts
    (`gate_up`, `down`: this rank's block of E/ep experts)."""
    ep = dist.get_world_size(group)
    local_experts = num_experts // ep
    top_k = top_k_index.shape[-1]
    # 1. (token, slot) pairs ordered by expert id; stable, so tokens keep their order within an expert.
    pair_expert = top_k_index.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)
    sent_per_expert = torch.bincount(pair_expert, minlength=num_experts)
    # 2. received_per_expert[s, e]: rows source rank s sends for this rank's local expert e.
    received_per_expert = torch.empty_like(sent_per_expert)
    dist.all_to_all_single(received_per_expert, sent_per_expert, group=group)
    # The one host sync of the layer: all-to-all split sizes are host integers.
    sent, received = torch.stack([sent_per_expert, received_per_expert]).view(2, ep, local_experts).tolist()
    send_splits = [sum(row) for row in sent]
    recv_splits = [sum(row) for row in received]
    # 3. dispatch: rows grouped by destination rank (consecutive experts = consecutive owners).
    tokens = hidden_states[order // top_k]
    arrived = _all_to_all(tokens, recv_splits, send_splits, group)
    # 4. `arrived` is ordered (source rank, local expert); group it by local expert for the matmuls.
    local_expert_of_row = torch.arange(local_experts, device=arrived.device).repeat(ep).repeat_interleave(
        torch.tensor(received, device=arrived.device).reshape(-1))
    by_expert = torch.argsort(local_expert_of_row, stable=True)
    per_expert = [sum(received[s][e] for s in range(ep)) for e in range(local_experts)]
    computed = local_experts_forward(arrived[by_expert], per_expert, gate_up, down, act_fn)
    results = torch.empty_like(computed).index_copy(0, by_expert, computed)  # back to (source rank, expert) order
    # 5. combine: back to the sending ranks, in `order`; weight and add as transformers does.
    returned = _all_to_all(results, send_splits, recv_splits, group)
    weighted = returned * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, order // top_k, weighted.to(hidden_states.dtype))


def expert_mesh(ep_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the experts live on: "ep", or ("ep", "tp") when the run has tensor parallelism too."""
    return ep_mesh["ep", "tp"] if "tp" in (ep_mesh.mesh_dim_names or ()) else ep_mesh["ep"]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, stage: bool = False) -> nn.Module:
    """Replace every fused-experts module of `model` by its expert-parallel form over ep_mesh["ep"], in place
    (after tensor parallelism, which left the experts replicated over "tp"). `stage`: `model` is one pipeline stage,
    which may hold dense layers only (the whole model was checked to have experts: parallel/dims.py)."""
    axis = ep_mesh["ep"]
    found = expert_modules(model)
    if not found and not stage:
        raise ConfigError(
            f"parallel.ep={axis.size()} needs a mixture-of-experts model with fused expert weights (gate_up_proj, "
            f"down_proj), but this {model.config.model_type} model has none; set parallel.ep=1"
        )
    for name, module in found.items():
        experts = module.gate_up_proj.shape[0]
        if experts % axis.size():
            raise ConfigError(f"parallel.ep={axis.size()} does not divide the model's {experts} experts ({name}); "
                              f"use a parallel.ep that divides {experts}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, ExpertParallelExperts(module, expert_mesh(ep_mesh)))
    return model


def sync_expert_grads(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Sum the expert gradients over the ranks that hold the same experts ("ep_replicate": DP size / ep
    ranks; nothing to do when ep equals the DP size), as the data-parallel sum does for dense gradients; under
    context parallelism over "cp" too (each CP rank's experts saw the tokens of its pieces only).
    Never over "tp": the TP ranks of an EP group ran the same tokens, so each already holds the whole gradient."""
    if ep_mesh is None:
        return
    names = ep_mesh.mesh_dim_names or ()
    axes = [axis for axis in ("ep_replicate", "cp") if axis in names and ep_mesh[axis].size() > 1]
    grads = [p.grad.to_local() for p in expert_parameters(model) if p.grad is not None]
    for axis in axes:
        all_reduce_flat(grads, ep_mesh[axis].get_group())
