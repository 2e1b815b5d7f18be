"""One DeviceMesh for the run, with named axes, and the groups every reduction uses.

    mesh axes: ("pp", "dp_replicate", "dp_shard", "cp", "tp")  flattened: "dp" = dp_replicate × dp_shard
    context parallel (cp > 1), flattened as torchtitan does: "dp_shard_cp" = dp_shard × cp (what FSDP2 shards
                     over), "dp_replicate_cp" = dp_replicate × cp (what DDP sums over when nothing is sharded)
    expert parallel: "dp" unflattened into ("ep_replicate", "ep") = (DP size / ep, ep); with TP the mesh
                     ("ep_replicate", "ep", "tp"), experts on its ("ep", "tp") part as (Shard(0), Replicate());
                     with CP ("ep_replicate", "cp", "ep"[, "tp"]): one set of EP groups per CP (and TP) coordinate;
                     with PP ("pp", "ep_replicate", "ep"[, "tp"]): one set per pipeline stage

The EP groups are runs of `ep` consecutive DP ranks (inside a dp_shard group when ep divides dp_shard, as
torchtitan carves its EP axis out of the FSDP axis): the ranks of one group hold different experts, the
ranks with the same "ep" coordinate hold the same experts and sum their gradients over "ep_replicate".

Ranks that differ only in their "tp" coordinate hold the same data. So the sampler, the token and loss
counts, the RL rollout split and every data metric use the DP rank and the DP group, never the world:
summing over the world would count each sample `tp` times. The same holds for "cp": the CP ranks of a DP rank
hold the same micro-batches (each runs its piece of every sequence), so counts are summed over DP, and only the
loss values, which each CP rank computes for its own tokens, are summed over CP too (train/step.py).

Pipeline parallel ("pp", outermost, as torchtitan orders it): the ranks of the "pp" axis hold different stages of
the model and run the same micro-batches one after the other, so like "tp" and "cp" it does not enter the DP group;
the loss, computed on the last stage only, is summed over "pp", and the gradient norm sums each stage's squares
once (train/step.py). The "dp" group, the sub-meshes FSDP2 shards over and the "tp" axis of a rank are those of its
"pp" coordinate: a stage's gradients are reduced over the DP ranks of that stage alone.

Gradients under CP: every CP rank backpropagates the loss of its own tokens, and the attention's backward (the
reverse all-to-all, or ring attention's dK/dV sent around the ring) carries into its activations the gradient of
the other ranks' losses, so a replicated weight's whole gradient is the SUM over the CP ranks of their parts,
exactly as over DP ranks. That is why CP joins the data-parallel axes of the gradient reduction: FSDP2 shards over
dp_shard × cp (its reduce-scatter sums over both, and each rank keeps 1/(dp_shard·cp) of the weights and AdamW
state), DDP sums over dp_replicate × cp, and so does sync_replica_grads under TP without FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from isotrain.parallel.dims import V_SHAPED, WORLD_NAMES, ParallelDims
from isotrain.parallel.dist import set_timeouts


@dataclass(frozen=True)
class ParallelState:
    """The run's layout as the trainer uses it: degrees, mesh, and this rank's place in it."""

    dims: ParallelDims
    mesh: DeviceMesh | None  # None for a single process
    rank: int
    dp_rank: int
    tp_rank: int
    # Always a real group when distributed (a group of one makes a reduction a no-op); None means "no
    # process group at all" and must never stand for the world.
    dp_group: object = None
    tp_group: object = None
    ep_mesh: DeviceMesh | None = None  # ("ep_replicate", "ep"[, "tp"]), only when dims.ep > 1
    cp_rank: int = 0
    cp_group: object = None  # the ranks that split one micro-batch's sequences; None when cp == 1
    pp_rank: int = 0  # this rank's pipeline stage
    pp_group: object = None  # the ranks that hold the stages of one model; None when pp == 1
    # The first and last stage ranks of this rank's pipeline (they hold the copies of a tied embedding, parallel/pp.py);
    # the pp group itself when pp == 2, None when pp == 1 or this rank's stage is in between.
    embed_group: object = None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.mesh is not None and self.dims.tp > 1 else None

    def dp_mesh(self) -> DeviceMesh:
        """The axes FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard; with context parallelism
        dp_shard × cp takes dp_shard's place (the CP ranks' gradients are summed like the shards')."""
        shard = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        if self.dims.dp_replicate > 1:
            return self.mesh["dp_replicate", shard]
        return self.mesh[shard]

    def replica_group(self):
        """The group DDP sums gradients over when nothing is sharded: dp_replicate, times cp under CP."""
        return self.mesh["dp_replicate_cp" if self.dims.cp > 1 else "dp_replicate"].get_group()


def single_process(dims: ParallelDims) -> ParallelState:
    return ParallelState(dims=dims, mesh=None, rank=0, dp_rank=0, tp_rank=0)


def _ep_mesh(dims: ParallelDims, mesh: DeviceMesh, dp: DeviceMesh, device: torch.device) -> DeviceMesh:
    """("ep_replicate", "ep"), the DP axis unflattened; with TP, ("ep_replicate", "ep", "tp"): the same EP groups
    once per TP coordinate (the world's ranks in the root mesh's order, DP-major, so "ep" groups ranks with
    the same TP index). With CP, ("ep_replicate", "cp", "ep"[, "tp"]): the same EP groups once per CP coordinate
    (each group's ranks route the same piece of their sequences); the ranks that differ in "cp" hold the same
    experts, and sum their gradients over "cp" beside "ep_replicate" (ep.py)."""
    shape = (dims.dp_size // dims.ep, dims.ep)
    if dims.pp > 1:
        return _stage_ep_mesh(dims, mesh, shape, device)
    if dims.cp > 1:  # root mesh (pp=1, dp_replicate, dp_shard, cp, tp): DP split into (ep_replicate, ep)
        ranks = mesh.mesh.reshape(*shape, dims.cp, dims.tp).permute(0, 2, 1, 3)
        names = ("ep_replicate", "cp", "ep", "tp")
        if dims.tp == 1:
            ranks, names = ranks[..., 0], names[:3]
        return DeviceMesh(device.type, ranks.contiguous(), mesh_dim_names=names)
    if dims.tp == 1:
        return dp._unflatten(0, shape, ("ep_replicate", "ep"))
    return DeviceMesh(device.type, mesh.mesh.reshape(*shape, dims.tp), mesh_dim_names=("ep_replicate", "ep", "tp"))


def _stage_ep_mesh(dims: ParallelDims, mesh: DeviceMesh, shape: tuple[int, int], device: torch.device) -> DeviceMesh:
    """Under pipeline parallelism, ("pp", "ep_replicate", "ep"[, "tp"]): the EP groups carved out of the DP ranks of
    each stage, one set per stage (and per TP coordinate), as they are per CP coordinate. A stage's experts are
    sharded over its own EP group and summed over its own "ep_replicate" ranks; slicing "ep" or "ep_replicate" gives
    this rank's stage's groups, and the mesh spans every rank, as a checkpoint's boxes need (parallel/boxes.py)."""
    ranks = mesh.mesh.reshape(dims.pp, *shape, dims.cp, dims.tp).permute(0, 1, 3, 2, 4)  # (pp, rep, cp, ep, tp)
    names = ("pp", "ep_replicate", "cp", "ep", "tp")
    for axis in (4, 2):  # drop the cp and tp axes of size 1, the last first
        if ranks.shape[axis] == 1:
            ranks, names = ranks.select(axis, 0), names[:axis] + names[axis + 1:]
    return DeviceMesh(device.type, ranks.contiguous(), mesh_dim_names=names)


def build_parallel(dims: ParallelDims, device: torch.device, rank: int,
                   timeout_s: float | None = None) -> ParallelState:
    """The 3-D mesh (every axis present, size 1 or more) and the flattened DP axis; a process outside any process
    group has none (a one-process torchrun launch has one: parallel/dist.py). Every group of the mesh waits
    `timeout_s` (parallel.timeout_s) in a collective, as the default group does."""
    if dims.world_size == 1 and not torch.distributed.is_initialized():
        return single_process(dims)
    mesh = init_device_mesh(device.type, tuple(getattr(dims, n) for n in WORLD_NAMES), mesh_dim_names=WORLD_NAMES)
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    ep_mesh = _ep_mesh(dims, mesh, dp, device) if dims.ep > 1 else None
    cp_meshes = []
    if dims.cp > 1:
        cp_meshes = [mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
                     mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp")]
    embed_group = _embed_group(dims, mesh, rank)
    set_timeouts([*mesh.get_all_groups(), dp.get_group(), *(ep_mesh.get_all_groups() if ep_mesh else []),
                  *(m.get_group() for m in cp_meshes), *([embed_group] if embed_group is not None else [])],
                 timeout_s)
    return ParallelState(
        dims=dims,
        mesh=mesh,
        rank=rank,
        dp_rank=dp.get_local_rank(),
        tp_rank=mesh["tp"].get_local_rank(),
        dp_group=dp.get_group(),
        tp_group=mesh["tp"].get_group(),
        ep_mesh=ep_mesh,
        cp_rank=mesh["cp"].get_local_rank(),
        cp_group=mesh["cp"].get_group() if dims.cp > 1 else None,
        pp_rank=mesh["pp"].get_local_rank(),
        pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
        embed_group=embed_group,
    )


def _embed_group(dims: ParallelDims, mesh: DeviceMesh, rank: int):
    """The group of the first and last stage ranks of this rank's pipeline (every rank creates every pipeline's, as
    torch.distributed.new_group requires); None for a rank of a stage in between, or without pipeline parallelism."""
    if dims.pp == 1 or dims.pp_schedule in V_SHAPED:  # (V: rank 0 holds both, one weight)
        return None
    if dims.pp == 2:
        return mesh["pp"].get_group()
    mine = None
    for pipeline in mesh.mesh.reshape(dims.pp, -1).T.tolist():  # each column: one pipeline's ranks, stage by stage
        group = torch.distributed.new_group([pipeline[0], pipeline[-1]])
        if rank in (pipeline[0], pipeline[-1]):
            mine = group
    return mine
