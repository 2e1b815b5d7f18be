"""Run one RL optimizer step (isotrain.rl.update.run_updates) in one layout; rank 0 saves the results.

Launched by test_rl_equivalence.py with torchrun (real processes, gloo) or in-process for 1 rank:
    rl_equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH     (LAYOUTS: e.g. 2x1,1x2 = DDP then FSDP2)
One launch covers every given layout (a mesh each) and every rl.loss_agg mode, each with
rl.mask_truncated off and on (the model is rebuilt for each), and one case with sequence-level masked IS
(CORRECTION_CASE):
results[(dp_replicate, dp_shard)][(loss_agg, mask_truncated)] = {loss, grads, stats, grad_norm, ...};
run() is one layout in this process.
An optional 4th argument MOE_LAYOUTS (e.g. 2x1x8,2x1x4: dp_replicate × dp_shard × micro-batch size) adds a
tiny Qwen3-MoE policy (4 experts, top-2) trained with its router terms (aux and z-loss) in both scopes:
results["moe"][(dp_replicate, dp_shard, micro_batch)][scope], in the same launch.

The rollout is fixed and the same in every process: P=4 prompts × n=4 samples with variable prompt
and response lengths, one empty response and one truncated one; per-token old log-probs are the
model's own plus fixed offsets of ±0.05 or ±0.3 (ratios 0.74, 0.95, 1.05, 1.35: far from the clip
edges 0.9 and 1.12, so fp rounding cannot flip a token's clipped state between layouts).
Micro-batches are packed (rl.pack_sequences' default; Llama keeps packed sequences apart by their position
ids), so every layout runs the packed forward; test_rl_packing.py compares packed with padded.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from isotrain.config import build_config
from isotrain.models.unwrap import unwrap
from isotrain.moe.settings import router_settings
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import build_parallel
from isotrain.rl.algos import LOSS_AGG_MODES
from isotrain.rl.experience import RolloutBatch, RowLayout, make_micro_batch, response_logprobs
from isotrain.rl.objective import STAT_NAMES, RLObjective
from isotrain.rl.update import UpdateContext, advantages, mini_batch_samples, run_updates
from isotrain.sizes import plan_rl_batches
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import step_options

VOCAB = 64
PROMPTS, GROUP = 4, 4
MAX_NEW_TOKENS = 8
LR = 1e-3
LAYOUT = RowLayout(packed=True)
MODEL_CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64}
# The MoE policy: every layer sparse, 4 experts, top-2. Coefficients far above the default 0.001, so the router
# terms move the gradients by much more than the tolerance (checked by test_rl_equivalence.py).
MOE_CONFIG = {**MODEL_CONFIG, "model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []}
MOE_SECTION = {"aux_loss_coef": 0.1, "z_loss_coef": 0.01}
MOE_LOSS_AGG = "seq-mean-token-mean"
# One more case: sequence-level masked IS of the engine–trainer mismatch instead of tis_cap, with bounds that keep
# some sequences of the fixed rollout (weight Π ρ) and drop others (test_rl_equivalence.py checks both happen):
# results[layout][CORRECTION_CASE].
CORRECTION = {"tis_cap": None, "rollout_correction": "seq_mis", "rollout_mask_low": 0.5, "rollout_mask_high": 2.0}
CORRECTION_CASE = ("seq-mean-token-mean", False, "seq_mis")


def tiny_model(model_config: dict = MODEL_CONFIG):
    torch.manual_seed(0)  # identical weights on every rank and in every layout
    config = AutoConfig.for_model(**model_config)
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config)


def make_config(loss_agg: str, mask_truncated: bool, micro_batch: int, dp_replicate: int, dp_shard: int, tp: int = 1,
                moe: dict | None = None, correction: dict | None = None):
    return build_config({
        "model": {"config": MODEL_CONFIG if moe is None else MOE_CONFIG},
        **({} if moe is None else {"moe": moe}),
        "train": {"micro_batch_size": micro_batch, "seed": 0, "grad_clip": 1.0},
        "parallel": {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp},
        "rl": {"algorithm": "grpo", "prompts_per_step": PROMPTS, "group_size": GROUP, "mini_batch_prompts": PROMPTS,
               "loss_agg": loss_agg, "mask_truncated": mask_truncated, "max_new_tokens": MAX_NEW_TOKENS,
               "clip_low": 0.1, "clip_high": 0.12, "kl_coef": 0.1, "kl_in_reward": False, "kl_estimator": "k3",
               "entropy_coef": 0.01, "tis_cap": 1.5, **(correction or {})},
    }, recipe="rl")


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
    own = response_logprobs(tiny_model(cfg.model.config), batch, pad_id=0, micro_batch_size=len(batch), temperature=1.0,
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


def run_mode(info, parallel, loss_agg: str, mask_truncated: bool, micro_batch: int, moe: dict | None = None,
             correction: dict | None = None) -> dict:
    """`moe`: the run's moe section, with the MoE policy (MOE_CONFIG) instead of the dense one; `correction`: rl
    settings of the mismatch correction instead of tis_cap."""
    degrees = parallel.dims
    cfg = make_config(loss_agg, mask_truncated, micro_batch, degrees.dp_replicate, degrees.dp_shard, degrees.tp, moe,
                      correction)
    plan = plan_rl_batches(cfg, degrees)
    batch = make_rollout()
    per_token = per_token_arrays(batch, cfg)
    model = wrap_replicas(parallelize(tiny_model(cfg.model.config), parallel), parallel)
    optimizer = build_optimizer(model, cfg.train)
    captured = {}

    def before_update():  # after every backward, before clipping and the optimizer step
        captured["grads"] = {n: full(p.grad) for n, p in unwrap(model).named_parameters()}

    router = router_settings(cfg.moe, unwrap(model).config)
    ctx = UpdateContext(cfg, plan, parallel.dp_rank, info.device, step_options(cfg, parallel, loss_parallel=False,
                                                                                router=router), 0, LAYOUT, before_update)
    totals = run_updates(model, optimizer, batch, per_token, ctx, step=0, lr_of=lambda k: LR)
    return {"loss": totals.loss_sum, "grads": captured["grads"], "stats": totals.stats.clone(),
            "grad_norm": totals.grad_norm_sum, "input_tokens": totals.input_tokens, "samples": totals.samples,
            "num_updates": totals.num_updates, "grad_accum_steps": plan.grad_accum_steps,
            "router": totals.router_means()}


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


def hf_aux_loss() -> float:
    """transformers' own load_balancing_loss_func over the whole rollout at the initial MoE weights: one padded
    row per sample, the attention mask built from the prompt + response lengths (padding excluded)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    batch = make_rollout()
    model = tiny_model(MOE_CONFIG)
    mb = make_micro_batch(batch, 0, False, {})
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)])
    attention_mask = (torch.arange(mb["input_ids"].shape[1]) < lengths[:, None]).long()
    with torch.no_grad():
        out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], output_router_logits=True)
    return float(load_balancing_loss_func(out.router_logits, MOE_CONFIG["num_experts"],
                                          MOE_CONFIG["num_experts_per_tok"], attention_mask))


def run(out: str, dp_replicate: int, dp_shard: int, micro_batch: int) -> None:
    """One dense layout in this process: results[(loss_agg, mask_truncated)]."""
    torch.save(run_layouts([(dp_replicate, dp_shard)], micro_batch)[(dp_replicate, dp_shard)], out)


MOE_SECTIONS = {"global": {**MOE_SECTION, "aux_loss_scope": "global"},
                "micro_batch": {**MOE_SECTION, "aux_loss_scope": "micro_batch"}}


def run_layouts(layouts: list[tuple[int, ...]], micro_batch: int, moe_layouts: list[tuple[int, int, int]] = (),
                moe_sections: dict[str, dict] = MOE_SECTIONS) -> dict | None:
    """Every (dp_replicate, dp_shard[, tp]) layout in turn, each with its own mesh and models, in one launch
    (the processes start once): results[layout][(loss_agg, mask_truncated)] on rank 0. Then the MoE policy
    (MOE_LOSS_AGG, mask_truncated on) in every (dp_replicate, dp_shard, micro_batch) of `moe_layouts`, with each
    named moe section: results["moe"][layout][name] (a 4th number: tensor parallel degree)."""
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for layout in layouts:
        parallel = build_parallel(ParallelDims(*layout, *(1,) * (3 - len(layout))), info.device, info.rank)
        results[layout] = {(mode, masked): run_mode(info, parallel, mode, masked, micro_batch)
                           for mode in LOSS_AGG_MODES for masked in (False, True)}
        mode, masked, _ = CORRECTION_CASE
        results[layout][CORRECTION_CASE] = run_mode(info, parallel, mode, masked, micro_batch, correction=CORRECTION)
    results["moe"] = {}
    for dp_replicate, dp_shard, moe_micro_batch, *tp in moe_layouts:
        parallel = build_parallel(ParallelDims(dp_replicate, dp_shard, *tp or (1,)), info.device, info.rank)
        results["moe"][(dp_replicate, dp_shard, moe_micro_batch, *tp)] = {
            name: run_mode(info, parallel, MOE_LOSS_AGG, True, moe_micro_batch, moe)
            for name, moe in moe_sections.items()}
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


def _layouts(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in layout.split("x")) for layout in text.split(",") if layout]


# ----------------------------------------------------------------------------- context parallelism (parallel.cp)
# results[layout][case][dtype] of `run_cp_layouts`, a layout being (dp_replicate, dp_shard, cp, cp_style). Every
# case runs 2 optimizer steps (rl.ppo_epochs=2; gradients of the first, weights after both) in fp32 and fp64:
#   grpo             token-mean (GRPO's aggregation), PPO clip, KL in the loss, entropy, truncated IS
#   seq-mean         seq-mean-token-mean: per-sequence weights 1/n_s of sequences cut across the pieces
#   dr-grpo          seq-mean-token-sum-norm (Dr. GRPO)
#   seq-mis          sequence-level masked IS of the given π_old (whole-row sums of Δ)
#   seq-mis-policy   the same with π_old the policy's own log-probs (no old_logprobs: gathered over CP per step)
#   ppo-critic       the critic (PPO's value model) takes its step too: its loss, gradients, values and weights
CP_CASES = {
    "grpo": ("token-mean", {}),
    "seq-mean": ("seq-mean-token-mean", {}),
    "dr-grpo": ("seq-mean-token-sum-norm", {}),
    "seq-mis": ("seq-mean-token-mean", CORRECTION),
    "seq-mis-policy": ("seq-mean-token-mean", CORRECTION),
    "ppo-critic": ("token-mean", {}),
}
CP_DTYPES = (torch.float32, torch.float64)


def tiny_critic(dtype: torch.dtype):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(1)
    config = AutoConfig.for_model(**MODEL_CONFIG, num_labels=1, classifier_dropout=0.0)
    config.use_cache = False
    return AutoModelForTokenClassification.from_config(config).to(dtype)


def _capturing(optimizer, into: dict, model) -> None:
    """Record the model's gradients of the first time `optimizer` steps (the critic's step has no before_update
    hook)."""
    step = optimizer.step

    def capture_then_step(*args, **kwargs):
        into.setdefault("grads", {n: full(p.grad) for n, p in unwrap(model).named_parameters()})
        return step(*args, **kwargs)

    optimizer.step = capture_then_step


def run_cp_case(info, parallel, case: str, dtype: torch.dtype, micro_batch: int) -> dict:
    """One CP_CASES case in one layout: the rollout's log-probs (and the critic's values) scored under the layout,
    then run_updates; the loss, gradients, weights after the steps and statistics."""
    from isotrain.rl.critic import token_values
    from isotrain.rl.pieces import Pieces

    loss_agg, correction = CP_CASES[case]
    degrees = parallel.dims
    cfg = make_config(loss_agg, False, micro_batch, degrees.dp_replicate, degrees.dp_shard,
                      correction={**correction, "ppo_epochs": 2})
    plan = plan_rl_batches(cfg, degrees)
    pieces = Pieces.of(parallel)
    batch = make_rollout()
    per_token = per_token_arrays(batch, cfg)
    if case == "seq-mis-policy":
        per_token["old_logprobs"] = None
    model = wrap_replicas(parallelize(tiny_model(cfg.model.config).to(dtype), parallel), parallel)
    scored = response_logprobs(model, batch, pad_id=0, micro_batch_size=micro_batch, temperature=1.0,
                               device=info.device, layout=LAYOUT, pieces=pieces)
    optimizer = build_optimizer(model, cfg.train)
    captured, critic_captured = {}, {}
    critic = critic_optimizer = values = None
    if case == "ppo-critic":
        critic = wrap_replicas(parallelize(tiny_critic(dtype), parallel), parallel)
        critic_optimizer = build_optimizer(critic, cfg.train)
        _capturing(critic_optimizer, critic_captured, critic)
        values = token_values(critic, batch, 0, micro_batch, info.device, layout=LAYOUT, pieces=pieces)
        rng = np.random.default_rng(11)
        per_token["old_values"] = [[v + float(rng.uniform(-0.1, 0.1)) for v in row] for row in values]
        per_token["returns"] = [[float(rng.uniform(-1, 1)) for _ in row] for row in values]

    def before_update():  # the first step's gradients
        captured.setdefault("grads", {n: full(p.grad) for n, p in unwrap(model).named_parameters()})

    ctx = UpdateContext(cfg, plan, parallel.dp_rank, info.device, step_options(cfg, parallel, loss_parallel=False), 0,
                        LAYOUT, before_update, critic, critic_optimizer, pieces)
    totals = run_updates(model, optimizer, batch, per_token, ctx, step=0, lr_of=lambda k: LR)
    result = {"loss": totals.loss_sum, "grads": captured["grads"], "stats": totals.stats.clone(),
              "grad_norm": totals.grad_norm_sum, "input_tokens": totals.input_tokens, "samples": totals.samples,
              "num_updates": totals.num_updates, "grad_accum_steps": plan.grad_accum_steps,
              "weights": {n: full(p) for n, p in unwrap(model).named_parameters()}, "logprobs": scored}
    if critic is not None:
        result["critic"] = {"loss": totals.critic_loss_sum, "stats": totals.critic_stats.clone(), "values": values,
                            "grads": critic_captured["grads"],
                            "weights": {n: full(p) for n, p in unwrap(critic).named_parameters()}}
    return result


def run_cp_layouts(layouts: list[tuple], micro_batch: int, cases=tuple(CP_CASES)) -> dict | None:
    """Every (dp_replicate, dp_shard, cp, cp_style) layout in one launch: results[layout][case][str(dtype)] on
    rank 0, else None."""
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for layout in layouts:
        dp_replicate, dp_shard, cp, style = layout
        parallel = build_parallel(ParallelDims(dp_replicate, dp_shard, 1, cp=cp, cp_style=style), info.device,
                                  info.rank)
        results[layout] = {case: {str(dtype): run_cp_case(info, parallel, case, dtype, micro_batch)
                                  for dtype in CP_DTYPES} for case in cases}
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


def _cp_layouts(text: str) -> list[tuple]:
    """DP_REPLICATExDP_SHARDxCPxSTYLE[,...], e.g. 1x1x2xulysses,1x1x2xring."""
    return [tuple(int(x) for x in layout.split("x")[:3]) + (layout.split("x")[3],) for layout in text.split(",")]


if __name__ == "__main__":
    if sys.argv[1] == "cp":  # rl_equivalence_worker.py cp OUT.pt CP_LAYOUTS MICRO_BATCH [CASES]
        out, layouts, micro, *cases = sys.argv[2:]
        results = run_cp_layouts(_cp_layouts(layouts), int(micro), *([cases[0].split(",")] if cases else []))
        if results is not None:
            torch.save(results, out)
        sys.exit(0)
    # rl_equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH [MOE_LAYOUTS]
    # LAYOUTS: DP_REPLICATExDP_SHARD[xTP][,...], e.g. 2x1,1x1x2; MOE_LAYOUTS: DP_REPLICATExDP_SHARDxMICRO_BATCH[xTP][,...]
    out, layouts, micro, *moe_layouts = sys.argv[1:]
    results = run_layouts(_layouts(layouts), int(micro), _layouts(moe_layouts[0]) if moe_layouts else [])
    if results is not None:
        torch.save(results, out)
