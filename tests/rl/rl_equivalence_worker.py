"""Run one RL optimizer step (isotrain.rl.update.run_updates) in one layout; rank 0 saves the results.

Launched by test_rl_equivalence.py with torchrun (real processes, gloo) or in-process for 1 rank:
    rl_equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH     (LAYOUTS: e.g. 2x1,1x2 = DDP then FSDP2)
One launch covers every given layout (a mesh each) and every rl.loss_agg mode, each with
rl.mask_truncated off and on (the model is rebuilt for each):
results[(dp_replicate, dp_shard)][(loss_agg, mask_truncated)] = {loss, grads, stats, grad_norm, ...};
run() is one layout in this process.

The rollout is fixed and the same in every process: P=4 prompts × n=4 samples with variable prompt
and response lengths, one empty response and one truncated one; per-token old log-probs are the
model's own plus fixed offsets of ±0.05 or ±0.3 (ratios 0.74, 0.95, 1.05, 1.35: far from the clip
edges 0.9 and 1.12, so fp rounding cannot flip a token's clipped state between layouts).
Micro-batches are packed (rl.pack_sequences' default; Llama keeps packed sequences apart by their position
ids), so every layout runs the packed forward; test_rl_packing.py compares packed with padded.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from isotrain.config import build_config
from isotrain.models.unwrap import unwrap
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import build_parallel
from isotrain.rl.algos import LOSS_AGG_MODES
from isotrain.rl.experience import RolloutBatch, RowLayout, make_micro_batch, response_logprobs
from isotrain.rl.objective import STAT_NAMES, RLObjective
from isotrain.rl.update import advantages, mini_batch_samples, run_updates
from isotrain.train.step import step_options
from isotrain.sizes import plan_rl_batches
from isotrain.train.optim import build_optimizer

VOCAB = 64
PROMPTS, GROUP = 4, 4
MAX_NEW_TOKENS = 8
LR = 1e-3
LAYOUT = RowLayout(packed=True)
MODEL_CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64}


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # identical weights on every rank and in every layout
    config = LlamaConfig(**{k: v for k, v in MODEL_CONFIG.items() if k != "model_type"})
    config.use_cache = False
    return LlamaForCausalLM(config)


def make_config(loss_agg: str, mask_truncated: bool, micro_batch: int, dp_replicate: int, dp_shard: int, tp: int = 1):
    return build_config({
        "model": {"config": MODEL_CONFIG},
        "train": {"micro_batch_size": micro_batch, "seed": 0, "grad_clip": 1.0},
        "parallel": {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp},
        "rl": {"algorithm": "grpo", "prompts_per_step": PROMPTS, "group_size": GROUP, "mini_batch_prompts": PROMPTS,
               "loss_agg": loss_agg, "mask_truncated": mask_truncated, "max_new_tokens": MAX_NEW_TOKENS,
               "clip_low": 0.1, "clip_high": 0.12, "kl_coef": 0.1, "kl_in_reward": False, "kl_estimator": "k3",
               "entropy_coef": 0.01, "tis_cap": 1.5},
    })


def make_rollout() -> RolloutBatch:
    """P × n samples in prompt-major order; sample 5 has an empty response, sample 10 is truncated."""
    rng = np.random.default_rng(1234)
    prompt_lens = [3, 7, 2, 5]
    response_lens = [[4, 6, 1, 3], [7, 0, 5, 2], [7, 3, MAX_NEW_TOKENS, 1], [2, 6, 4, 5]]
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, -1.0, 1.0, 0.25], [0.75, 0.75, 0.0, 1.0], [0.2, 0.9, 0.4, 0.1]]
    rows = {name: [] for name in ("prompt_index", "prompt_ids", "response_ids", "truncated", "rewards")}
    for g in range(PROMPTS):
        prompt = rng.integers(1, VOCAB, size=prompt_lens[g]).tolist()
        for k in range(GROUP):
            length = response_lens[g][k]
            rows["prompt_index"].append(g)
            rows["prompt_ids"].append(prompt)
            rows["response_ids"].append(rng.integers(1, VOCAB, size=length).tolist())
            rows["truncated"].append(length == MAX_NEW_TOKENS)
            rows["rewards"].append(rewards[g][k])
    batch = RolloutBatch(engine_logprobs=[[] for _ in rows["prompt_ids"]], scores=list(rows["rewards"]), **rows)
    assert sum(batch.truncated) == 1 and sum(len(r) == 0 for r in batch.response_ids) == 1
    return batch


def per_token_arrays(batch: RolloutBatch, cfg) -> dict:
    """old = the model's own log-probs + fixed offsets; ref and engine = other fixed values; advantages."""
    own = response_logprobs(tiny_model(), batch, pad_id=0, micro_batch_size=len(batch), temperature=1.0,
                            device=torch.device("cpu"))
    rng = np.random.default_rng(7)
    offsets = np.array([-0.3, -0.05, 0.05, 0.3])
    old = [[x + float(rng.choice(offsets)) for x in row] for row in own]
    ref = [[x + float(rng.uniform(-0.5, 0.5)) for x in row] for row in own]
    batch.engine_logprobs = [[x + float(rng.uniform(-0.6, 0.6)) for x in row] for row in old]
    return {"advantages": advantages(batch, cfg.rl, old, ref)[0], "old_logprobs": old, "ref_logprobs": ref,
            "engine_logprobs": batch.engine_logprobs}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_mode(info, parallel, loss_agg: str, mask_truncated: bool, micro_batch: int) -> dict:
    degrees = parallel.dims
    cfg = make_config(loss_agg, mask_truncated, micro_batch, degrees.dp_replicate, degrees.dp_shard, degrees.tp)
    plan = plan_rl_batches(cfg, degrees)
    batch = make_rollout()
    per_token = per_token_arrays(batch, cfg)
    model = wrap_replicas(parallelize(tiny_model(), parallel), parallel)
    optimizer = build_optimizer(model, cfg.train)
    captured = {}

    def before_update():  # after every backward, before clipping and the optimizer step
        captured["grads"] = {n: full(p.grad) for n, p in unwrap(model).named_parameters()}

    ctx = SimpleNamespace(cfg=cfg, plan=plan, rank=parallel.dp_rank, device=info.device, pad_id=0, layout=LAYOUT,
                          options=step_options(cfg, parallel, loss_parallel=False), before_update=before_update)
    totals = run_updates(model, optimizer, batch, per_token, ctx, step=0, lr_of=lambda k: LR)
    return {"loss": totals.loss_sum, "grads": captured["grads"], "stats": totals.stats.clone(),
            "grad_norm": totals.grad_norm_sum, "input_tokens": totals.input_tokens, "samples": totals.samples,
            "num_updates": totals.num_updates, "grad_accum_steps": plan.grad_accum_steps}


def naive_mode(loss_agg: str, micro_batch: int) -> dict:
    """The classic bug, in one process: each micro-batch divided by its own denominator, then the
    per-micro-batch means averaged. Same rollout, same objective, same micro-batches as run_updates."""
    cfg = make_config(loss_agg, False, micro_batch, 1, 1)
    plan = plan_rl_batches(cfg, ParallelDims(1, 1, 1))
    batch = make_rollout()
    per_token = per_token_arrays(batch, cfg)
    model = tiny_model()
    objective = RLObjective(cfg.rl)
    (samples,) = mini_batch_samples(0, 0, cfg.train.seed, plan.prompts_per_step, plan.mini_batch_prompts, GROUP)
    micro = [samples[i : i + micro_batch] for i in range(0, len(samples), micro_batch)]
    stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    loss = 0.0
    for ix in micro:
        mb = make_micro_batch(batch.select(ix), 0, cfg.rl.mask_truncated,
                              {k: [v[i] for i in ix] for k, v in per_token.items()})
        part = objective.loss_sum(model, mb, torch.autocast("cpu", enabled=False), torch.device("cpu"), stats)
        part = part / max(objective.denominator(mb), 1) / len(micro)
        part.backward()
        loss += float(part.detach())
    return {"loss": loss, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def run(out: str, dp_replicate: int, dp_shard: int, micro_batch: int) -> None:
    """One layout in this process: results[(loss_agg, mask_truncated)]."""
    torch.save(run_layouts([(dp_replicate, dp_shard)], micro_batch)[(dp_replicate, dp_shard)], out)


def run_layouts(layouts: list[tuple[int, ...]], micro_batch: int) -> dict | None:
    """Every (dp_replicate, dp_shard[, tp]) layout in turn, each with its own mesh and models, in one launch
    (the processes start once): results[layout][(loss_agg, mask_truncated)] on rank 0."""
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for layout in layouts:
        parallel = build_parallel(ParallelDims(*layout, *(1,) * (3 - len(layout))), info.device, info.rank)
        results[layout] = {(mode, masked): run_mode(info, parallel, mode, masked, micro_batch)
                           for mode in LOSS_AGG_MODES for masked in (False, True)}
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


if __name__ == "__main__":
    # rl_equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH; LAYOUTS: DP_REPLICATExDP_SHARD[xTP][,...], e.g. 2x1,1x1x2
    out, layouts, micro = sys.argv[1:]
    results = run_layouts([tuple(int(x) for x in layout.split("x")) for layout in layouts.split(",")], int(micro))
    if results is not None:
        torch.save(results, out)
