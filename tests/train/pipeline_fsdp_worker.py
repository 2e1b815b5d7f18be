"""equivalence_worker.py for interleaved 1F1B beside FSDP2, counting FSDP2's gradient reductions.

    pipeline_fsdp_worker.py OUT.pt LAYOUTS MICRO_BATCH [families=...] [stage_unsharded] [fp64_token]

As equivalence_worker.py (same layouts, results and flags), and each result also holds, for every rank, how many
times FSDP2 reduced a group of gradients over the DP shard group (`foreach_reduce`: one reduce-scatter) during
each optimizer step's forward and backward passes: results[key][(reduction, dtype)]["reduces"][rank][step].
`stage_unsharded` leaves the last stage's root out of FSDP2 on purpose (its final norm and head then stay whole
tensors whose gradients no one sums over the DP ranks): the control that must fail. `fp64_token`: the token mean
in fp64 alone (the one run the control needs).
"""

from __future__ import annotations

import sys

import torch

import equivalence_worker as worker
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

REDUCES: list[int] = []  # FSDP2 reductions of this rank in each step of the current run


def _counted(foreach_reduce):
    def reduce(*args, **kwargs):
        REDUCES[-1] += 1
        return foreach_reduce(*args, **kwargs)

    return reduce


def _per_step(forward_backward):
    def step(*args, **kwargs):
        REDUCES.append(0)
        return forward_backward(*args, **kwargs)

    return step


def _gathered(run_layout):
    """run_layout, and every rank's reductions per step in its result."""

    def run(*args, **kwargs):
        REDUCES.clear()
        result = run_layout(*args, **kwargs)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, list(REDUCES))
        return {**result, "reduces": gathered}

    return run


def _last_stage_unsharded() -> None:
    """fully_shard every stage root but the last stage's."""
    import isotrain.parallel.apply as apply

    shard = apply.fully_shard

    def fully_shard(module, **kwargs):
        if isinstance(module, apply.StageModule) and module.model.lm_head.__class__.__name__ != "HandOff":
            return module
        return shard(module, **kwargs)

    apply.fully_shard = fully_shard


def _fp64_token_only(layouts: list, micro_batch: int, families: list[str]) -> dict | None:
    """worker.run_layouts for the token mean in fp64 alone: results[(family, layout)][("token", fp64)]."""
    from isotrain.parallel.dist import init_distributed, shutdown_distributed
    from isotrain.parallel.mesh import build_parallel

    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for family in families:
        for layout in layouts:
            dims, layout = worker._dims(layout)
            parallel = build_parallel(dims, info.device, info.rank)
            results[(family, layout)] = {("token", str(torch.float64)): worker.run_layout(
                info, parallel, micro_batch, "token", torch.float64, False, family=family)}
    shutdown_distributed()
    return results if info.is_main else None


if __name__ == "__main__":
    out, layouts, micro, *rest = sys.argv[1:]
    families = next((flag.split("=", 1)[1].split(",") for flag in rest if flag.startswith("families=")), ["llama"])
    _fsdp_param_group.foreach_reduce = _counted(_fsdp_param_group.foreach_reduce)
    worker.forward_backward = _per_step(worker.forward_backward)
    worker.run_layout = _gathered(worker.run_layout)
    if "stage_unsharded" in rest:
        _last_stage_unsharded()
    if "fp64_token" in rest:  # one run, the one the control compares
        results = _fp64_token_only([worker._parse_layout(layout) for layout in layouts.split(",")], int(micro),
                                   families)
    else:
        results = worker.run_layouts([worker._parse_layout(layout) for layout in layouts.split(",")], int(micro),
                                     families=families)
    if results is not None:
        torch.save(results, out)
