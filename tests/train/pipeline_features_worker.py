"""3 optimizer steps of a tiny 4-layer Llama under pipeline parallelism with one feature that PP composes with:
the chunked cross-entropy, LoRA adapters, compiled decoder layers. Rank 0 saves the results.

    pipeline_features_worker.py OUT.pt CASE[,CASE...]      (2 gloo processes: PP 2, 1F1B, 4 micro-batches)

CASE is `name:dtype[:reduction]`, e.g. `chunk:float64:sequence`, `lora:float32`, `compile:float32` (`plain`: none
of them; `chunk_moe`: the chunked loss on a 2-layer Qwen3-MoE, with its router terms; a name ending in
`_interleaved` runs under interleaved 1F1B, 2 stages per rank, `_zbv` and `_izb` under the zero-bubble ZBV and
interleaved zero bubble, 2 stages per rank; a case ending in `@RxSxT` runs PP 2 beside
dp_replicate R, dp_shard S, tp T: 8 / (2 · DP) micro-batches of 2 per DP rank); results[CASE] holds the losses
and gradient norms of the steps, the first step's gradients and the final weights of the trained parameters and the
frozen ones (every stage's, by name). `lora_head` adapts the head alone, which leaves the first stage nothing to
train: results[CASE] = {"error": [each rank's message]}. `backend=NAME` compiles with that torch.compile backend.
`run_case` with a single-process ParallelState is the reference, in the test's own process. The data is
test_equivalence.py's (variable lengths, padding, masked prompts, one packed sample).
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import torch

from equivalence_worker import GLOBAL_BATCH, NUM_STEPS, _all_stages, full, make_samples, tiny_model
from isotrain.config import LoraConfig, MoeConfig, TrainConfig
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.errors import ConfigError
from isotrain.models.unwrap import unwrap
from isotrain.moe.settings import router_settings
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import lora_adapter, step_options
from isotrain.train.stage_data import stage_micro_batches
from isotrain.train.step import forward_backward, optimizer_step, shared_parameters

FAMILY = "llama_4layers"
CHUNK_TOKENS = 7  # chunks cross rows and documents
SCHEDULES = {"interleaved": "interleaved_1f1b", "zbv": "zbv", "izb": "interleaved_zb"}  # case suffix: schedule
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def run_case(parallel, case: str, micro_batch: int, chunk_tokens: int | None = None) -> dict:
    """One case on this rank's layout. `chunk_tokens` overrides the case's (None: CHUNK_TOKENS for `chunk`, else 0)."""
    name, dtype, *reduction = case.split(":")
    reduction = reduction[0] if reduction else "token"
    name = name.split("_")[0] if name.endswith(tuple(SCHEDULES)) else name  # (the schedule is the layout's)
    if chunk_tokens is None:
        chunk_tokens = CHUNK_TOKENS if name.startswith("chunk") else 0
    moe = name.endswith("_moe")  # an MoE model: its router terms too (the global scope's pre-pass through the stages)
    model = parallelize(tiny_model(getattr(torch, dtype), "qwen3_moe" if moe else FAMILY), parallel,
                        compile=name == "compile", loss_parallel=True)
    lora = {"lora": LORA, "lora_head": LoraConfig(r=4, alpha=8, target_modules=["lm_head"])}.get(name, LoraConfig())
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"), lora=lora,
                          train=SimpleNamespace(loss_reduction=reduction, grad_clip=1.0, seed=0,
                                                loss_chunk_tokens=chunk_tokens, compile=name == "compile"))
    adapt = lora_adapter(cfg, parallel.dims)
    try:
        model = wrap_replicas(adapt(model) if adapt else model, parallel).train()
    except ConfigError as err:
        messages = [None] * parallel.dims.pp
        torch.distributed.all_gather_object(messages, str(err), group=parallel.pp_group)
        return {"error": messages}
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    router = router_settings(MoeConfig(aux_loss_coef=0.5, z_loss_coef=0.01), unwrap(model).config) if moe else None
    options = step_options(cfg, parallel, router=router)
    samples = make_samples()
    sampler = GlobalBatchSampler(len(samples), GLOBAL_BATCH, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    # Compiled: every row padded to the longest sample's 20 tokens, one shape (as the SFT recipe pads compiled runs)
    length = 20 if name == "compile" else None
    losses, norms, grads, held_twice = [], [], None, []
    for step in range(NUM_STEPS):
        index_lists = sampler.micro_batches(step, parallel.dp_rank, parallel.dp_size, micro_batch)
        micro_batches = stage_micro_batches(lambda idx: collate([samples[i] for i in idx], pad_id=0, length=length),
                                            index_lists, parallel, reduction, torch.device("cpu"))
        loss, _ = forward_backward(model, micro_batches, options, torch.device("cpu"))  # (with the router terms)
        if step == 0:
            grads = _all_stages({n: full(p.grad) for n, p in unwrap(model).named_parameters() if p.requires_grad},
                                parallel, held_twice)
        losses.append(loss)
        norms.append(optimizer_step(optimizer, params, lr=1e-2, grad_clip=1.0, loss=loss, stages=parallel.dims.pp,
                                    shared=shared_parameters(model, options)))
    weights = _all_stages({n: full(p) for n, p in unwrap(model).named_parameters() if p.requires_grad}, parallel,
                          held_twice)
    frozen = _all_stages({n: full(p) for n, p in unwrap(model).named_parameters() if not p.requires_grad}, parallel,
                         held_twice)
    assert not held_twice, "two stages hold one tensor"
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights, "frozen": frozen}


def compile_with(backend: str) -> None:
    """Every `nn.Module.compile` of this process (parallel/apply.py compiles each decoder layer) with `backend`."""
    compile = torch.nn.Module.compile
    torch.nn.Module.compile = lambda module, *args, **kwargs: compile(module, *args, backend=backend, **kwargs)


def main(out: str, cases: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for case in cases:  # `_interleaved`: interleaved 1F1B, 2 one-layer stages per rank; `@RxSxT`: beside DP and TP
        name, _, layout = case.partition("@")
        degrees = tuple(int(x) for x in layout.split("x")) if layout else (1, 1, 1)
        schedule = SCHEDULES.get(name.split(":")[0].rpartition("_")[2], "1f1b")
        per_rank = 1 if schedule == "1f1b" else 2
        dims = ParallelDims(*degrees, pp=info.world_size // math.prod(degrees), pp_stages_per_rank=per_rank,
                            pp_schedule=schedule)
        results[case] = run_case(build_parallel(dims, info.device, info.rank), name, micro_batch=2)
    shutdown_distributed()
    if info.is_main:
        torch.save(results, out)


if __name__ == "__main__":
    # pipeline_features_worker.py OUT.pt CASES [backend=NAME]
    for flag in sys.argv[3:]:
        compile_with(flag.removeprefix("backend="))
    main(sys.argv[1], sys.argv[2].split(","))
