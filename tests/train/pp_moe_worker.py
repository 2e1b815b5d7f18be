"""Train a tiny Qwen3-MoE model (4 experts, top-2, aux 0.5, z 0.01) for 3 steps under pipeline parallelism, with
expert parallelism beside it or with middle stages; rank 0 saves the results.

Launched by test_pipeline_moe.py on forked ranks (gloo), or in-process for the 1-process reference:
    pp_moe_worker.py OUT.pt RUNS [layers=N] [family=F] [scope=S] [packings=0,1] [dtypes=float64] [save=DIR]
    [experts_in_replica_sum] [experts_not_summed]
RUNS as moe_worker.py's (`2x1x1x2/pp2-1f1b:2`: PP 2 × DDP 2 × EP 2, micro-batch size 2; `1x1x1/pp2x2-zbv:2`: PP 2
with 2 stages per rank under zbv; a third field, `:micro_batch`, names that run's own aux-loss scope). The data is
read as the SFT recipe reads it (train/stage_data.py): a middle stage of PP > 2 gets each micro-batch's position and
segment ids and counts alone. results[(family, scope, packed, dtype, layout, micro_batch)] = {losses, aux, z, counts,
norms, grads (first step, before the update), weights (after the last), experts (placements, local shape)}, family a
moe_worker.py FAMILIES name (qwen3_moe by default), scope moe.aux_loss_scope (global by default): the keys of
moe_worker.py, so that test_moe_equivalence.py's comparisons read them. `save=DIR`: the fp64 run of the first
layout also writes a checkpoint (model and optimizer state) there, as a run's checkpoint manager does under PP.
`experts_in_replica_sum` sums the expert gradients over the stage's DP replicas as the dense ones are, on purpose:
ranks that hold different experts, a control that must fail; `experts_not_summed` (on 8 ranks, where each expert
block of a stage has two holders) leaves them unsummed over the stage's "ep_replicate" ranks, another.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from equivalence_worker import GLOBAL_BATCH, _all_stages, full, make_samples
from moe_worker import MOE, packed_samples, tiny_moe
from moe_worker import _dims as _flat_dims
from isotrain.checkpoint.load import CheckpointReader, load_model
from isotrain.checkpoint.save import SaveRequest, save
from isotrain.checkpoint.state import assign_owners, collect_items, other_stage_keys, pipeline_items
from isotrain.config import TrainConfig
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.models.unwrap import unwrap
from isotrain.moe.settings import router_settings
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.parallel.pp import Pipeline
from isotrain.train.optim import build_optimizer
from isotrain.train.stage_data import stage_micro_batches
from isotrain.train.step import StepOptions, train_step

STEPS = 3


def _dims(layout: tuple) -> ParallelDims:
    """moe_worker.py's layouts, and "ppNxV-schedule": PP N with V stages per rank (interleaved_1f1b, zbv)."""
    style = layout[-1]
    if isinstance(style, str) and style.startswith("pp") and "x" in style.split("-")[0]:
        stages, schedule = style.removeprefix("pp").split("-")
        pp, per_rank = (int(n) for n in stages.split("x"))
        return ParallelDims(*layout[:-1], pp=pp, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    return _flat_dims(layout)


def run_one(info, parallel, family: str, layers: int, packed: bool, dtype: torch.dtype, micro_batch: int,
            save_dir: Path | None = None, scope: str = "global") -> dict:
    model = parallelize(tiny_moe(family, dtype, layers), parallel).train()
    model = wrap_replicas(model, parallel)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    settings = router_settings(MOE.model_copy(update={"aux_loss_scope": scope}), unwrap(model).config)
    options = StepOptions(grad_clip=1.0, dp_group=parallel.dp_group, parallel=parallel, router=settings,
                          pipeline=Pipeline.of(parallel))
    samples = packed_samples() if packed else make_samples()
    sampler = GlobalBatchSampler(len(samples), GLOBAL_BATCH, seed=0)
    out = {"losses": [], "aux": [], "z": [], "counts": [], "norms": []}
    for step in range(STEPS):
        index_lists = sampler.micro_batches(step, parallel.dp_rank, parallel.dp_size, micro_batch)
        micro_batches = stage_micro_batches(lambda idx: collate([samples[i] for i in idx], pad_id=0), index_lists,
                                            parallel, "token", info.device)

        def keep_grads():
            if step == 0:
                out["grads"] = _all_stages({n: full(p.grad) for n, p in unwrap(model).named_parameters()}, parallel,
                                           [])

        result = train_step(model, optimizer, micro_batches, 1e-2, options, info.device, before_update=keep_grads)
        for key, value in (("losses", result.loss), ("aux", result.router.aux_loss), ("z", result.router.z_loss),
                           ("counts", result.router.counts), ("norms", result.grad_norm)):
            out[key].append(value)
    out["weights"] = _all_stages({n: full(p) for n, p in unwrap(model).named_parameters()}, parallel, [])
    out["experts"] = {n: (tuple(p.placements), tuple(p.to_local().shape)) for n, p in unwrap(model).named_parameters()
                      if n.endswith("experts.gate_up_proj") and isinstance(p, DTensor)}
    if save_dir is not None:
        save_checkpoint(save_dir, model, optimizer, parallel, dtype)
    return out


def save_checkpoint(root: Path, model, optimizer, parallel, dtype: torch.dtype) -> None:
    """Model and optimizer state as the checkpoint manager writes them under PP (checkpoint/manager.py `_items`):
    each stage's tensors, under the full model's names, written by its own ranks; config.json beside them. Then read
    back into the model, strictly, as a resume reads it (the same values)."""
    items = collect_items(model, optimizer, dtype)
    if parallel.dims.pp > 1:
        items = pipeline_items(items, dist.group.WORLD)
    assign_owners(items, parallel.world_size)
    config = copy.deepcopy(unwrap(model).config)
    config.architectures = [type(unwrap(model)).__name__]
    request = SaveRequest(STEPS, items, rank_files={}, main_files={"config.json": config.to_json_string().encode()},
                          info={"kind": "test"})
    directory = save(root, request, parallel.rank, dist.group.WORLD if dist.is_initialized() else None, run_id="test",
                     name="saved")
    # Read back strictly into the same layout, as a resume does: each stage finds the other stages' keys (a MoE
    # model's per-expert keys among them) known, not foreign.
    elsewhere = other_stage_keys(model, dist.group.WORLD) if parallel.dims.pp > 1 else frozenset()
    reader = CheckpointReader(directory)
    try:
        load_model(reader, model, parallel.rank, strict=True, elsewhere=elsewhere)
    finally:
        reader.close()


def run_all(runs: list[tuple[tuple, int]], layers: int = 2, packings=(False, True),
            dtypes=(torch.float32, torch.float64), save_dir: Path | None = None,
            family: str = "qwen3_moe", scope: str = "global") -> dict | None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for index, (layout, micro_batch, *own_scope) in enumerate(runs):  # a run may name its own scope
        parallel = build_parallel(_dims(layout), info.device, info.rank)
        run_scope = own_scope[0] if own_scope else scope
        for packed in packings:
            for dtype in dtypes:
                saving = save_dir if index == 0 and dtype == torch.float64 and packed == packings[0] else None
                results[(family, run_scope, packed, str(dtype), layout, micro_batch)] = run_one(
                    info, parallel, family, layers, packed, dtype, micro_batch, saving, run_scope)
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


def _experts_in_replica_sum() -> None:
    """On purpose: the stage's DP replica sum takes the experts too (sync_replica_grads leaves out none)."""
    import isotrain.parallel.apply as apply

    apply.expert_parameters = lambda model: []


if __name__ == "__main__":
    out, spec, *flags = sys.argv[1:]
    parsed = []
    for run in spec.split(","):
        layout, micro, *own_scope = run.split(":")
        degrees, _, style = layout.partition("/")
        parsed.append((tuple(int(x) for x in degrees.split("x")) + ((style,) if style else ()), int(micro),
                       *own_scope))

    def flag(name: str, default):
        return next((f.split("=", 1)[1].split(",") for f in flags if f.startswith(name + "=")), default)

    if "experts_in_replica_sum" in flags:
        _experts_in_replica_sum()
    if "experts_not_summed" in flags:  # on purpose: no sum over the ranks holding the same experts
        import isotrain.parallel.apply as apply

        apply.sync_expert_grads = lambda model, ep_mesh: None
    save_to = flag("save", None)
    results = run_all(parsed, layers=int(flag("layers", ["2"])[0]),
                      packings=tuple(bool(int(p)) for p in flag("packings", ["0", "1"])),
                      dtypes=tuple(getattr(torch, d) for d in flag("dtypes", ["float32", "float64"])),
                      save_dir=Path(save_to[0]) if save_to else None, family=flag("family", ["qwen3_moe"])[0],
                      scope=flag("scope", ["global"])[0])
    if results is not None:
        torch.save(results, out)
