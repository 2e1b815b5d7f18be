"""Packed RL micro-batches (rl.pack_sequences) are the same math as padded ones.

A fixed rollout of 4 prompts × 4 samples whose responses end with EOS at seeded, varied lengths (1 to 11
tokens, one truncated at the budget without EOS) runs the whole trainer side of an RL step twice, padded
and packed: old-policy log-probs, the frozen reference's log-probs, PPO's critic values, advantages, then
run_updates (one optimizer step over micro-batches of 4 samples; the old policy is the policy's own
log-probs moved by fixed offsets, so ratios are not 1 and some tokens are clipped). Every per-token output
(log-probs, reference log-probs, values, advantages), the loss, every gradient of the policy (and of the
critic) and the logged token statistics agree within 1e-6 relative; token counts exactly. (A second
optimizer step would compare gradients at weights that AdamW has already moved apart by rounding.) Llama keeps
packed sequences apart by its position ids; OPT ignores them and gets isotrain's per-document mask.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from isotrain.config import ModelConfig, build_config
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import single_process
from isotrain.rl.critic import token_values
from isotrain.rl.experience import PADDED, RolloutBatch, RowLayout, make_micro_batch, per_sample, response_logprobs
from isotrain.rl.packing import row_layout
from isotrain.rl.update import UpdateContext, advantages, run_updates
from isotrain.sizes import plan_rl_batches
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import step_options

CPU = torch.device("cpu")
RTOL = 1e-6
PROMPTS, GROUP, MAX_NEW_TOKENS = 4, 4, 12
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
OPT = {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "word_embed_proj_dim": 32, "max_position_embeddings": 64, "dropout": 0.0, "attention_dropout": 0.0}
BLOOM = {"model_type": "bloom", "hidden_size": 32, "n_layer": 2, "n_head": 4}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["0123456789 abcdefghijklmnopqrstuvwxyz+="] * 4, "char", 64)


def model_cfg(config: dict) -> ModelConfig:
    return ModelConfig(config=config, attn_implementation="sdpa")


def make_rollout(tokenizer) -> RolloutBatch:
    """Responses end with EOS after a seeded number of tokens (early stops), one runs out of budget."""
    rng = np.random.default_rng(5)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    rows = {name: [] for name in ("prompt_index", "prompt_ids", "response_ids", "truncated", "rewards")}
    for g, prompt_len in enumerate([3, 8, 2, 6]):
        prompt = [tokenizer.bos_token_id] + rng.integers(4, vocab, size=prompt_len - 1).tolist()
        for k in range(GROUP):
            truncated = g == 2 and k == 1
            stop = MAX_NEW_TOKENS if truncated else int(rng.integers(1, MAX_NEW_TOKENS))
            body = rng.integers(4, vocab, size=stop - (0 if truncated else 1)).tolist()
            rows["prompt_index"].append(g)
            rows["prompt_ids"].append(prompt)
            rows["response_ids"].append(body if truncated else body + [eos])
            rows["truncated"].append(truncated)
            rows["rewards"].append(float(rng.choice([0.0, 0.5, 1.0])))
    lengths = {len(r) for r in rows["response_ids"]}
    assert 1 in lengths and MAX_NEW_TOKENS in lengths and len(lengths) >= 6
    return RolloutBatch(engine_logprobs=[[] for _ in rows["prompt_ids"]], scores=list(rows["rewards"]), **rows)


def make_config(config: dict, algorithm: str, loss_agg: str):
    rl = {"algorithm": algorithm, "prompts_per_step": PROMPTS, "group_size": GROUP, "mini_batch_prompts": PROMPTS,
          "loss_agg": loss_agg, "max_new_tokens": MAX_NEW_TOKENS, "clip_low": 0.1, "clip_high": 0.12,
          "kl_coef": 0.1, "kl_in_reward": algorithm == "ppo", "entropy_coef": 0.01, "tis_cap": 1.5,
          "mask_truncated": loss_agg == "seq-mean-token-sum"}
    return build_config({"model": {"config": config, "attn_implementation": "sdpa"},
                         "train": {"micro_batch_size": 4, "seed": 0, "grad_clip": 1.0, "lr": 1e-2},
                         "rl": rl}, recipe="rl")


def capture_grads(model, store: list) -> None:
    """After every backward of a step, before the optimizer: each parameter's accumulated gradient."""
    store.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def rl_trainer_step(tokenizer, config: dict, algorithm: str, loss_agg: str, layout: RowLayout) -> dict:
    """The trainer side of one RL step (log-probs, reference, values, advantages, updates) in `layout`."""
    cfg = make_config(config, algorithm, loss_agg)
    parallel = single_process(ParallelDims(1, 1, 1))
    plan = plan_rl_batches(cfg, parallel.dims)
    batch = make_rollout(tokenizer)
    policy = build_plain(cfg.model, tokenizer, seed=0)
    reference = build_plain(cfg.model, tokenizer, seed=1, trainable=False)
    score = dict(batch=batch, pad_id=tokenizer.pad_token_id, micro_batch_size=4, temperature=1.0, device=CPU,
                 layout=layout)
    own, ref = response_logprobs(policy, **score), response_logprobs(reference, **score)
    # The old policy as if one update had passed: the policy's own log-probs moved by ±0.05 or ±0.3 (ratios
    # far from the clip edges 0.9 and 1.12, so rounding cannot flip a token's clipped state).
    rng = np.random.default_rng(9)
    old = [[x + float(rng.choice([-0.3, -0.05, 0.05, 0.3])) for x in row] for row in own]
    batch.engine_logprobs = [[x + float(rng.uniform(-0.3, 0.3)) for x in row] for row in old]
    critic = critic_optimizer = values = None
    if algorithm == "ppo":
        from transformers import AutoModelForTokenClassification

        # No dropout in the value head (transformers' default is 0.1): both runs must see the same network.
        critic = build_plain(cfg.model, tokenizer, seed=0, model_class=AutoModelForTokenClassification,
                             config_updates={"num_labels": 1, "classifier_dropout": 0.0})
        critic_optimizer = build_optimizer(critic, cfg.train)
        values = token_values(critic, batch, tokenizer.pad_token_id, 4, CPU, layout=layout)
    token_advantages, returns = advantages(batch, cfg.rl, old, ref, values)
    per_token = {"advantages": token_advantages, "old_logprobs": old, "ref_logprobs": ref,
                 "engine_logprobs": batch.engine_logprobs, "old_values": values, "returns": returns}
    grads, critic_grads = [], []
    if critic is not None:  # the critic's step has no hook: wrap its optimizer's step
        step = critic_optimizer.step
        critic_optimizer.step = lambda *a, **k: (capture_grads(critic, critic_grads), step(*a, **k))[1]
    ctx = UpdateContext(cfg, plan, 0, CPU, step_options(cfg, parallel, loss_parallel=False), tokenizer.pad_token_id,
                        layout, lambda: capture_grads(policy, grads), critic, critic_optimizer)
    totals = run_updates(policy, build_optimizer(policy, cfg.train), batch, per_token, ctx, 0, lambda k: 1e-2)
    assert totals.num_updates == 1 and len(grads) == 1
    return {"per_token": {"own": own, "ref": ref, "values": values, "advantages": token_advantages},
            "loss": totals.loss_sum, "critic_loss": totals.critic_loss_sum, "stats": totals.stats,
            "critic_stats": totals.critic_stats, "input_tokens": totals.input_tokens, "grads": grads,
            "critic_grads": critic_grads}


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_same(packed: dict, padded: dict) -> None:
    for name, rows in padded["per_token"].items():
        if rows is not None:
            assert [len(r) for r in packed["per_token"][name]] == [len(r) for r in rows], name
            flat = [x for r in rows for x in r]
            assert rel([x for r in packed["per_token"][name] for x in r], flat) <= RTOL, name
    assert packed["input_tokens"] == padded["input_tokens"]
    assert packed["stats"][0] == padded["stats"][0]  # trained tokens, exactly
    assert rel(packed["stats"], padded["stats"]) <= RTOL
    assert rel(packed["loss"], padded["loss"]) <= RTOL
    assert rel(packed["critic_loss"], padded["critic_loss"]) <= RTOL
    assert rel(packed["critic_stats"], padded["critic_stats"]) <= RTOL
    for which in ("grads", "critic_grads"):
        assert len(packed[which]) == len(padded[which])
        for step, (got, want) in enumerate(zip(packed[which], padded[which])):
            assert got.keys() == want.keys()
            largest = max(float(g.abs().max()) for g in want.values())
            for name, grad in want.items():
                if name.endswith("k_proj.bias"):
                    # Zero in exact arithmetic (softmax ignores a constant added to every score of a query):
                    # both are rounding noise (~1e-11), so only their size is compared.
                    assert max(float(got[name].abs().max()), float(grad.abs().max())) <= RTOL * largest, name
                    continue
                assert rel(got[name], grad) <= RTOL, f"{which} of step {step}: {name} {rel(got[name], grad):.2e}"


CASES = {
    "grpo-token-mean": (LLAMA, "grpo", "token-mean", False),
    "grpo-seq-mean-token-mean": (LLAMA, "grpo", "seq-mean-token-mean", False),
    "dr_grpo-seq-mean-token-sum-norm": (LLAMA, "dr_grpo", "seq-mean-token-sum-norm", False),
    "grpo-seq-mean-token-sum-masked-truncated": (LLAMA, "grpo", "seq-mean-token-sum", False),
    "ppo-critic-seq-mean-token-mean": (LLAMA, "ppo", "seq-mean-token-mean", False),
    "opt-grpo-seq-mean-token-mean": (OPT, "grpo", "seq-mean-token-mean", True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_packed_update_equals_padded(tokenizer, case):
    config, algorithm, loss_agg, needs_mask = CASES[case]
    padded = rl_trainer_step(tokenizer, config, algorithm, loss_agg, PADDED)
    packed = rl_trainer_step(tokenizer, config, algorithm, loss_agg, RowLayout(packed=True, document_mask=needs_mask))
    assert_same(packed, padded)
    assert 0 < padded["stats"][2] < padded["stats"][0]  # some tokens, not all, are clipped
    if algorithm == "ppo":
        assert len(packed["critic_grads"]) == 1 and packed["critic_loss"] > 0


def test_opt_without_the_mask_would_differ(tokenizer):
    """The mask matters: OPT's packed rows without it let sequences attend to the ones before them."""
    padded = rl_trainer_step(tokenizer, OPT, "grpo", "token-mean", PADDED)
    leaky = rl_trainer_step(tokenizer, OPT, "grpo", "token-mean", RowLayout(packed=True))
    flat = {name: [x for r in run["per_token"]["own"] for x in r]
            for name, run in (("leaky", leaky), ("padded", padded))}
    assert rel(flat["leaky"], flat["padded"]) > 1000 * RTOL
    grads = leaky["grads"][0]
    assert max(rel(grads[n], g) for n, g in padded["grads"][0].items() if not n.endswith("k_proj.bias")) > 1000 * RTOL


def test_packed_rows_are_fewer_and_restart_their_positions(tokenizer):
    batch = make_rollout(tokenizer)
    values = [[float(100 * i + j) for j in range(len(r))] for i, r in enumerate(batch.response_ids)]
    padded = make_micro_batch(batch, tokenizer.pad_token_id, False, {"x": values})
    packed = make_micro_batch(batch, tokenizer.pad_token_id, False, {"x": values}, RowLayout(packed=True))
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert padded["input_ids"].shape == (16, max(lengths))
    assert packed["input_ids"].shape[1] == max(lengths) and packed["input_ids"].shape[0] < 16
    assert int((packed["position_ids"] == 0).sum()) == 16  # one restart per sequence
    assert packed["mask"].sum() == padded["mask"].sum() == sum(len(r) for r in batch.response_ids)
    assert per_sample(packed, packed["x"]) == per_sample(padded, padded["x"]) == values
    # Each response token's target is the token itself, scored one position before it.
    assert per_sample(packed, packed["targets"]) == batch.response_ids


def test_the_run_decides_the_layout_from_its_models(tokenizer):
    def settings(cfg):
        return cfg.rl.pack_sequences, cfg.model.dtype

    logged = []
    cfg = build_config({"model": {"config": LLAMA}, "rl": {"max_new_tokens": 4}}, recipe="rl")
    parallel = single_process(ParallelDims(1, 1, 1))
    llama, opt = (build_plain(model_cfg(c), tokenizer, seed=0) for c in (LLAMA, OPT))
    bloom = build_plain(ModelConfig(config=BLOOM, attn_implementation="eager"), tokenizer, seed=0)
    assert row_layout(*settings(cfg), parallel, CPU, logged.append, llama) == RowLayout(packed=True)
    assert row_layout(*settings(cfg), parallel, CPU, logged.append, opt) == RowLayout(packed=True, document_mask=True)
    assert row_layout(*settings(cfg), parallel, CPU, logged.append, bloom) == PADDED
    assert logged[-1] == ("rl.pack_sequences: BloomForCausalLM cannot keep packed sequences apart (it ignores "
                          "position-id restarts and cannot take isotrain's per-document mask); the RL forwards use "
                          "padded rows")
    off = build_config({"model": {"config": LLAMA}, "rl": {"max_new_tokens": 4, "pack_sequences": False}}, recipe="rl")
    assert row_layout(*settings(off), parallel, CPU, logged.append, llama) == PADDED
    assert len(logged) == 3  # one line per decision that probed
