"""Train a tiny MoE model (qwen3_moe, mixtral: 4 experts, top-2) for 2 steps (`steps=N`: N) in one layout; rank 0
saves results.

Launched by test_moe_equivalence.py with torchrun (real processes, gloo) or in-process for 1 rank:
    moe_worker.py OUT.pt RUNS [scopes=..] [families=..] [packings=0,1] [dtypes=float64] [steps=N] [loads_over_dp_only]
    [pool_per_stage]
RUNS: comma-separated RxSxT[xE[xC]][/ring|/ppN-SCHEDULE]:MICRO (dp_replicate x dp_shard x tp x ep x cp:
ParallelDims' field order; `/ring` for parallel.cp_style=ring, `/pp2-1f1b` for PP 2 with 1F1B; micro-batch size).
Every run covers both families, both aux-loss scopes, packed and unpacked data, fp32 and fp64 unless the flags narrow
them:
results[(family, scope, packed, dtype, layout, micro_batch)] = {losses, aux, z, counts, grads, weights}, layout
the degrees' tuple (with "ring" or "pp2-1f1b" appended). Gradients are those `train_step` leaves before its
first update (taken in `before_update`). `loads_over_dp_only` sums the routing loads over DP but not CP, and
`pool_per_stage` leaves each pipeline stage's pool without the other stages' layers, on purpose: controls that must
fail.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from equivalence_worker import GLOBAL_BATCH, VOCAB, _all_stages, full, make_samples
from isotrain.config import MoeConfig, TrainConfig
from isotrain.data.collate import collate
from isotrain.data.packing import Sample
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.models.unwrap import unwrap
from isotrain.moe.settings import router_settings
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.parallel.pp import Pipeline
from isotrain.parallel.tp import check_replicated
from isotrain.train.optim import build_optimizer
from isotrain.train.step import StepOptions, train_step

NUM_STEPS = 2
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "head_dim": 8},
    "mixtral": {"num_local_experts": 4, "sliding_window": None},
    # Shared expert and its gate next to the routed ones; checked on demand (families=qwen2_moe), not in the suite.
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    # Layer 1 dense (its MLP split by TP's plan), layer 0 sparse; checked on demand (families=qwen3_moe_dense).
    "qwen3_moe_dense": {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                        "decoder_sparse_step": 1, "mlp_only_layers": [1], "head_dim": 8},
    # Layer 0 dense, layer 1 sparse: under PP 2 the first stage routes nothing (tests/train/test_pipeline_moe.py).
    "qwen3_moe_dense_first": {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                              "decoder_sparse_step": 1, "mlp_only_layers": [0], "head_dim": 8},
}
SUITE_FAMILIES = ("qwen3_moe", "mixtral")
# Large enough that the router terms move the router's gradient far beyond the tolerance when their pool is wrong.
MOE = MoeConfig(aux_loss_coef=0.5, z_loss_coef=0.01)


def tiny_moe(family: str, dtype: torch.dtype, layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = dict(FAMILIES[family])
    config = AutoConfig.for_model(extra.pop("model_type", family), vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  num_experts_per_tok=2, **extra)
    config.use_cache = False
    # transformers' default grouped_mm experts kernel takes no fp64; its eager loop computes the same maths.
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager" if dtype == torch.float64 else None)
    # Confident routers (logits of order 1, not 0.02): no near-ties whose top-k choice could flip on fp32 rounding.
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            torch.nn.init.normal_(param, std=1.0)
    return model.to(dtype)


def packed_samples() -> list[Sample]:
    """16 packed rows, each two documents of make_samples(32) back to back (positions restart per document)."""
    docs = make_samples(32, seed=1)
    rows = []
    for a, b in zip(docs[::2], docs[1::2]):
        rows.append(Sample(np.concatenate([a.input_ids, b.input_ids]), np.concatenate([a.labels, b.labels]),
                           np.concatenate([a.position_ids, b.position_ids]),
                           np.concatenate([a.segment_ids, b.segment_ids + a.segment_ids.max() + 1]),
                           a.row_ids + b.row_ids))
    return rows


def run_one(info, parallel, family: str, scope: str, packed: bool, dtype: torch.dtype, micro_batch: int,
            force_reroute: bool = False, checkpointing: bool = False, steps: int = NUM_STEPS) -> dict:
    model = parallelize(tiny_moe(family, dtype), parallel, activation_checkpointing=checkpointing)
    model = wrap_replicas(model.train(), parallel)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    settings = router_settings(MOE.model_copy(update={"aux_loss_scope": scope}), unwrap(model).config)
    dims = parallel.dims
    pipeline = (Pipeline(parallel.pp_rank, dims.pp, parallel.pp_group, dims.pp_schedule) if dims.pp > 1 else None)
    options = StepOptions(grad_clip=1.0, dp_group=parallel.dp_group, parallel=parallel, router=settings,
                          pipeline=pipeline)
    samples = packed_samples() if packed else make_samples()
    sampler = GlobalBatchSampler(len(samples), GLOBAL_BATCH, seed=0)
    out = {"losses": [], "aux": [], "z": [], "counts": [], "norms": []}
    for step in range(steps):
        index_lists = sampler.micro_batches(step, parallel.dp_rank, parallel.dp_size, micro_batch)
        micro_batches = [collate([samples[i] for i in idx], pad_id=0) for idx in index_lists]

        def keep_grads():
            if step == 0:
                out["grads"] = _all_stages({n: full(p.grad) for n, p in unwrap(model).named_parameters()}, parallel,
                                           [])

        if force_reroute:
            _reroute_after_prepass(model, len(micro_batches))
        result = train_step(model, optimizer, micro_batches, 1e-2, options, info.device, before_update=keep_grads)
        out["losses"].append(result.loss)
        out["aux"].append(result.router.aux_loss)
        out["z"].append(result.router.z_loss)
        out["counts"].append(result.router.counts)
        out["norms"].append(result.grad_norm)
        if step == 0:  # a replicated parameter (router, experts under TP) whose TP ranks drifted apart fails here
            check_replicated(model, parallel.tp_group)
    out["weights"] = _all_stages({n: full(p) for n, p in unwrap(model).named_parameters()}, parallel, [])
    # How the experts are laid out on this rank: placements and local shape (E / ep experts under EP).
    out["experts"] = {n: (tuple(p.placements), tuple(p.to_local().shape)) for n, p in unwrap(model).named_parameters()
                      if n.endswith("experts.gate_up_proj") and isinstance(p, DTensor)}
    return out


def _reroute_after_prepass(model, num_micro_batches: int) -> None:
    """Make the gradient pass route differently from its pre-pass: once the pre-pass forwards are done, the
    first router's logits are negated (its top-k becomes its bottom-k), as router noise could do."""
    router = unwrap(model).model.layers[0].mlp.gate
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] > num_micro_batches:  # a gradient-pass forward
            return (-output[0], *output[1:])
        return output

    router.register_forward_hook(hook)


def _dims(layout: tuple) -> ParallelDims:
    """(1, 1, 1, 1, 2) -> CP 2 with Ulysses; (1, 1, 1, 1, 2, "ring") -> with ring attention; (1, 1, 1, "pp2-1f1b")
    -> PP 2 with 1F1B."""
    if layout[-1] == "ring":
        return ParallelDims(*layout[:-1], cp_style="ring")
    if isinstance(layout[-1], str):
        pp, schedule = layout[-1].removeprefix("pp").split("-")
        return ParallelDims(*layout[:-1], pp=int(pp), pp_schedule=schedule)
    return ParallelDims(*layout)


def run_all(runs: list[tuple[tuple, int]], families=SUITE_FAMILIES, scopes=("global", "micro_batch"),
            packings=(False, True), dtypes=(torch.float32, torch.float64), force_reroute: bool = False,
            checkpointing: bool = False, steps: int = NUM_STEPS) -> dict | None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for layout, micro_batch in runs:
        parallel = build_parallel(_dims(layout), info.device, info.rank)
        for family in families:
            for scope in scopes:
                for packed in packings:
                    for dtype in dtypes:
                        key = (family, scope, packed, str(dtype), layout, micro_batch)
                        results[key] = run_one(info, parallel, family, scope, packed, dtype, micro_batch,
                                               force_reroute, checkpointing, steps)
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


if __name__ == "__main__":
    # moe_worker.py OUT.pt RUNS [scopes=global,...] [families=qwen3_moe,...]
    out, runs, *flags = sys.argv[1:]
    parsed = []
    for run in runs.split(","):
        layout, micro = run.split(":")
        degrees, _, style = layout.partition("/")
        parsed.append((tuple(int(x) for x in degrees.split("x")) + ((style,) if style else ()), int(micro)))

    def flag(name: str, default):
        return next((f.split("=", 1)[1].split(",") for f in flags if f.startswith(name + "=")), default)

    if "loads_over_dp_only" in flags:  # on purpose: each CP rank's pool misses the other pieces' tokens
        import isotrain.moe.objective as objective
        import isotrain.moe.prepass as prepass
        from isotrain.parallel.dist import all_reduce_sum

        objective.sum_over_pool = prepass.sum_over_pool = lambda values, dp_group, cp_group=None: all_reduce_sum(
            values, dp_group)
    if "pool_per_stage" in flags:  # on purpose: under PP each stage's pool holds its own layers' loads only
        from isotrain.moe.objective import RouterStep
        from isotrain.parallel.dist import all_reduce_sum

        pipeline_pool = RouterStep.set_pipeline_pool

        def own_stage_pool(self, expected, masks, pp_group):
            pipeline_pool(self, expected, masks, pp_group)
            self.global_counts = all_reduce_sum(self._model_rows(torch.stack(expected).sum(0)).to(torch.int64),
                                                self.group)

        RouterStep.set_pipeline_pool = own_stage_pool
    results = run_all(parsed, scopes=tuple(flag("scopes", ["global", "micro_batch"])),
                      families=tuple(flag("families", SUITE_FAMILIES)),
                      packings=tuple(bool(int(p)) for p in flag("packings", ["0", "1"])),
                      dtypes=tuple(getattr(torch, d) for d in flag("dtypes", ["float32", "float64"])),
                      steps=int(flag("steps", [NUM_STEPS])[0]))
    if results is not None:
        torch.save(results, out)
