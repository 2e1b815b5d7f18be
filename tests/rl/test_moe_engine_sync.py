"""isotrain's own rollout engines (`hf`, `process`) fed a mixture-of-experts policy the way the RL loop feeds them:
`saved_named_tensors`, the experts one tensor per expert and projection (never a layer's fused experts gathered whole:
tests/rl/test_moe_weight_sync.py shows the stream in every layout), the engine writing each into its block of its
fused parameter.

Proven here, on the tiny Qwen3-MoE of engine_models.tiny_moe (fp32):
- after each of 2 updates the engine's checksums are the trainer's, key for key (per-expert keys), and it decodes
  the trainer's greedy responses with the trainer's log-probs within 1e-5 (HFEngine in process, ProcessEngine across a
  spawned child);
- a sync that leaves out one expert's projection leaves that fused parameter stale: generate refuses, naming it,
  until a complete sync;
- the fused names (`sync_named_tensors`) are still taken, and the checksums then follow them;
- `isotrain rl` with rollout.engine=hf under FSDP2 2 × EP 2 syncs that way: no rank gathers a fused expert tensor;
- the probe a vLLM run makes after each sync leaves FSDP2 2 × TP 2 × EP 2 able to train (probe_fsdp_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engine_models
from isotrain.models.weights import checksums, saved_named_tensors, sync_named_tensors
from isotrain.rl.engine_process import ProcessEngine
from isotrain.rl.rollout import HFEngine, SamplingParams
from test_cli_errors import TINY_RL
from test_rl_e2e import metrics
from test_weight_sync import train_steps, trainer_greedy
from test_vllm_engine import max_gap, trainer_logprobs
from zygote import run_forked_ranks

PROMPTS = [[1, 7, 8], [1, 9, 9, 9, 10, 11], [1, 12]]
GREEDY = SamplingParams(n=1, max_new_tokens=8, greedy=True)
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture(scope="module")
def tokenizer():
    return engine_models.digits_tokenizer()


def check_synced(engine, policy, tokenizer) -> None:
    engine.update_weights(saved_named_tensors(policy))
    sent = checksums(saved_named_tensors(policy))
    assert engine.checksums() == sent and EXPERT in sent and not any("gate_up_proj" in key for key in sent)
    rollout = engine.generate(PROMPTS, GREEDY)
    assert rollout.response_ids == trainer_greedy(policy, tokenizer)
    # (the KV-cache decode and one full forward round differently: measured up to 1.5e-6)
    assert max_gap(rollout.response_logprobs, trainer_logprobs(policy, rollout)) <= 1e-5


@pytest.mark.parametrize("kind", ["hf", "process"])
def test_the_engines_take_the_experts_one_tensor_at_a_time(tokenizer, tmp_path, kind):
    policy = engine_models.tiny_moe(tokenizer)
    if kind == "hf":
        engine = HFEngine.from_config(policy.config, tokenizer)
    else:
        tokenizer.save_pretrained(tmp_path)
        engine = ProcessEngine(policy.config, tmp_path, seed=0, num_threads=1)
    try:
        check_synced(engine, policy, tokenizer)
        for _ in train_steps(policy, 2):
            check_synced(engine, policy, tokenizer)
        # One expert's projection left out: its layer's fused down_proj is stale until a complete sync.
        next(train_steps(policy, 1))
        engine.update_weights((key, t) for key, t in saved_named_tensors(policy) if key != EXPERT)
        with pytest.raises(RuntimeError, match=r"1 of \d+ engine weights are stale or released \(e.g. "
                                               r"model.layers.1.mlp.experts.down_proj\); call update_weights first"):
            engine.generate(PROMPTS, GREEDY)
        check_synced(engine, policy, tokenizer)
        # The fused names still work; the checksums follow the names sent.
        engine.update_weights(sync_named_tensors(policy))
        assert engine.checksums() == checksums(sync_named_tensors(policy))
    finally:
        engine.close()


# The MoE policy of test_vllm_moe.py's runs on isotrain's own engine: 2 steps under FSDP2 2 × EP 2.
MOE_HF_RL = [*TINY_RL, "model.config.model_type=qwen3_moe", "model.config.hidden_size=64",
             "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1", "model.config.head_dim=32",
             "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
             "model.config.moe_intermediate_size=32", "train.max_steps=2", "rollout.engine=hf",
             "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.ep=2"]


def test_isotrain_rl_sends_the_experts_one_expert_at_a_time_to_its_own_engine(tmp_path):
    """`isotrain rl` on FSDP2 2 × EP 2 with rollout.engine=hf: every sync (the start's, each update's) passes the
    checksums under per-expert keys, and no rank ever gathers a fused expert tensor whole (no 3-D `full_tensor`),
    while it does gather the dense tensors that FSDP2 shards (one at a time)."""
    out = tmp_path / "gathered"
    proc = run_forked_ranks(2, [str(out), *MOE_HF_RL, f"output_dir={tmp_path / 'run'}"],
                            script=str(Path(__file__).with_name("moe_rl_sync_worker.py")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    for rank in range(2):
        shapes = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert shapes and all(len(shape) < 3 for shape in shapes), shapes


def test_the_vllm_probe_leaves_fsdp2_and_tp_ready_to_train(tmp_path):
    """FSDP2 2 × TP 2 × EP 2: every sync followed by the probe a vLLM run makes (its forward has no backward). Left
    gathered by it, the next step's backward failed ("Trying to resize storage that is not resizable"), as in
    `isotrain rl rollout.engine=vllm` under FSDP2 2 × TP 2 with and without EP; the probe reshards them."""
    argv = [a for a in MOE_HF_RL if "num_key_value_heads" not in a] + [
        "model.config.num_key_value_heads=2", "parallel.tp=2", f"output_dir={tmp_path / 'run'}"]
    proc = run_forked_ranks(4, argv, script=str(Path(__file__).with_name("probe_fsdp_worker.py")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    assert proc.stdout.count("probe ") == 4 * 3  # the start's and both updates' on each rank
