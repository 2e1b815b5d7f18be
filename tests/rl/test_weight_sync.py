"""Weight sync trainer -> engine: after every optimizer step the engine holds exactly the trainer's weights.

Checked in process (HFEngine), across a real process boundary (ProcessEngine, spawn) and with
LoRA (the engine gets the merged weights W + scale * B @ A).
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal

import pytest
import torch
import engine_models

from isotrain.errors import ConfigError
from isotrain.models.lora import apply_lora, merged_state_dict, reference_logits_context, save_adapter
from isotrain.rl.engine_process import ProcessEngine
from isotrain.rl.rollout import HFEngine, SamplingParams
from isotrain.models.weights import checksums, sync_named_tensors

PROMPTS = [[1, 7, 8], [1, 9, 9, 9, 10, 11], [1, 12]]
GREEDY = SamplingParams(n=1, max_new_tokens=8, greedy=True)


@pytest.fixture(scope="module")
def tokenizer():
    return engine_models.digits_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def tiny_model(tokenizer, seed: int = 0):
    return engine_models.tiny_model(tokenizer, seed, tie=True)  # the engine must keep the head tied to the embedding


@pytest.fixture(scope="module")
def process_engine(tokenizer, tokenizer_dir):
    # One child serves every test of this module: each test sends all weights before using it.
    engine = ProcessEngine(tiny_model(tokenizer).config, tokenizer_dir, seed=0, num_threads=1)
    yield engine
    engine.close()


def train_steps(model, num_steps: int):
    """Plain AdamW on random tokens; yields after each optimizer step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for step in range(num_steps):
        tokens = torch.randint(4, model.config.vocab_size, (4, 12))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        yield step
    model.eval()


def trainer_greedy(model, tokenizer) -> list[list[int]]:
    """Greedy responses of the trainer's own model (peft or plain), cut after the first EOS."""
    eos, responses = tokenizer.eos_token_id, []
    for prompt in PROMPTS:
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=GREEDY.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
        )
        tokens = out[0, len(prompt) :].tolist()
        responses.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return responses


def _sync_every_step(model, engine, num_steps: int = 3) -> None:
    previous = engine.checksums()
    for _ in train_steps(model, num_steps):
        assert engine.checksums() == previous  # the engine only changes on sync
        engine.update_weights(sync_named_tensors(model))
        expected = checksums(sync_named_tensors(model))
        assert engine.checksums() == expected
        assert expected != previous  # the step changed the weights, so equality is not vacuous
        previous = expected


def test_hf_engine_sync_after_every_step(tokenizer):
    model = tiny_model(tokenizer)
    engine = HFEngine(model, tokenizer)
    _sync_every_step(model, engine)
    assert engine.generate(PROMPTS, GREEDY).response_ids == trainer_greedy(model, tokenizer)


def test_sync_yields_plain_fp32_cpu_copies(tokenizer):
    model = tiny_model(tokenizer)
    named = dict(sync_named_tensors(model))
    assert list(named) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        assert named[name].dtype == torch.float32 and named[name].device.type == "cpu"
        assert named[name].data_ptr() != param.data_ptr()  # never aliases the trainer's storage
        torch.testing.assert_close(named[name], param.detach(), atol=0, rtol=0)


def test_process_engine_sync_after_every_step(tokenizer, process_engine):
    model = tiny_model(tokenizer, seed=1)
    process_engine.update_weights(sync_named_tensors(model))
    _sync_every_step(model, process_engine)
    assert process_engine.generate(PROMPTS, GREEDY).response_ids == trainer_greedy(model, tokenizer)


def test_lora_sync_sends_merged_weights(tokenizer, process_engine):
    model = apply_lora(tiny_model(tokenizer, seed=2), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    base = checksums(sync_named_tensors(model))  # B = 0 at initialisation: merged == base
    assert not any("lora_" in name or name.startswith("base_model") for name in base)
    assert list(base) == [name for name, _ in tiny_model(tokenizer).named_parameters()]
    process_engine.update_weights(sync_named_tensors(model))
    trainer_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _sync_every_step(model, process_engine)

    merged = checksums(sync_named_tensors(model))
    changed = {name for name in merged if merged[name] != base[name]}
    assert changed == {name for name in base if name.endswith(("q_proj.weight", "v_proj.weight"))}
    # The merge happens on copies: syncing left the trainer's (unmerged) model untouched.
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in merged_state_dict(model).items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)
    assert all(not torch.equal(p, trainer_before[n]) == ("lora_" in n) for n, p in model.named_parameters())
    assert process_engine.generate(PROMPTS, GREEDY).response_ids == trainer_greedy(model, tokenizer)


def test_lora_reference_context_is_the_frozen_base(tokenizer, tmp_path):
    base = tiny_model(tokenizer, seed=3)
    tokens = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        base_logits = base(tokens).logits
    model = apply_lora(copy.deepcopy(base), r=4, alpha=8, target_modules=["q_proj", "o_proj"])
    for _ in train_steps(model, 2):
        pass
    with torch.no_grad():
        with reference_logits_context(model) as reference:
            torch.testing.assert_close(reference(tokens).logits, base_logits, atol=0, rtol=0)
        assert not torch.allclose(model(tokens).logits, base_logits, atol=1e-4)  # adapters back on
    saved = save_adapter(model, tmp_path / "adapter")
    assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()


def test_lora_unknown_target_names_the_linear_modules(tokenizer):
    with pytest.raises(ConfigError, match="'qproj' matches no linear layer.*down_proj, .*q_proj"):
        apply_lora(tiny_model(tokenizer), r=4, alpha=8, target_modules=["q_proj", "qproj"])


def test_release_memory_then_sync(tokenizer, process_engine):
    model = tiny_model(tokenizer, seed=4)
    process_engine.update_weights(sync_named_tensors(model))
    process_engine.release_memory()
    assert process_engine.checksums() == {}
    with pytest.raises(RuntimeError, match="failed in generate: RuntimeError: .*call update_weights first"):
        process_engine.generate(PROMPTS, GREEDY)
    process_engine.update_weights(sync_named_tensors(model))
    assert process_engine.checksums() == checksums(sync_named_tensors(model))
    assert process_engine.generate(PROMPTS, GREEDY).response_ids == trainer_greedy(model, tokenizer)


def test_failed_sync_leaves_process_engine_stale(tokenizer, process_engine):
    model = tiny_model(tokenizer, seed=6)
    process_engine.update_weights(sync_named_tensors(model))

    def failing_sync():
        named = sync_named_tensors(model)
        yield next(named)
        raise OSError("trainer lost a shard")

    with pytest.raises(OSError, match="lost a shard"):
        process_engine.update_weights(failing_sync())
    # The child holds one new tensor and the rest old: it must refuse to sample from that mix.
    with pytest.raises(RuntimeError, match="call update_weights first"):
        process_engine.generate(PROMPTS, GREEDY)
    process_engine.update_weights(sync_named_tensors(model))
    assert process_engine.generate(PROMPTS, GREEDY).response_ids == trainer_greedy(model, tokenizer)


@contextlib.contextmanager
def num_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def test_process_engine_seeding_errors_and_death(tokenizer, tokenizer_dir):
    model = tiny_model(tokenizer, seed=5)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.8)
    # The caller runs at a thread count other than torch's default, which is where a spawned child
    # starts: the engine must take the caller's count, because the 9-row decode batches below
    # round their 9th row differently at 1 and 2 threads (see engine_process), and the rollouts
    # are compared bit for bit.
    caller_threads = 2 if torch.get_num_threads() == 1 else 1
    with num_threads(caller_threads):
        _check_seeding_errors_and_death(model, tokenizer, tokenizer_dir, params)


def _check_seeding_errors_and_death(model, tokenizer, tokenizer_dir, params) -> None:
    engine = ProcessEngine(model.config, tokenizer_dir, seed=11)
    try:
        # The child starts without usable weights: its random initialisation never samples.
        with pytest.raises(RuntimeError, match="call update_weights first"):
            engine.generate(PROMPTS, params)  # generate call 0
        engine.update_weights(sync_named_tensors(model))
        rollouts = [engine.generate(PROMPTS, params) for _ in range(2)]  # calls 1 and 2
        # Call k is seeded with seed + k: the same draws as an in-process engine seeded that way.
        local = HFEngine(model, tokenizer)
        for call, rollout in zip((1, 2), rollouts):
            torch.manual_seed(11 + call)
            assert local.generate(PROMPTS, params) == rollout
        assert rollouts[0].response_ids != rollouts[1].response_ids

        with pytest.raises(RuntimeError, match="failed in update_weights: ValueError: .*unknown weight 'lm_head.bias'"):
            engine.update_weights([("lm_head.bias", torch.zeros(3))])
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"pid {engine.pid}\) is dead \(exit code -9\)"):
            engine.checksums()
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.checksums()


# The run's script (forked from the zygote, run as `python SCRIPT ARGV`): from the second sync on, the in-process
# engine silently keeps its old final-norm weight, as an engine whose sync delivered all but one tensor would.
STALE_NORM = """
import sys

import isotrain.cli
import isotrain.rl.rollout as rollout

original, calls = rollout.HFEngine.update_weights, []

def update_weights(self, named_tensors):
    calls.append(1)
    skip = "model.norm.weight" if len(calls) > 1 else None
    return original(self, ((name, t) for name, t in named_tensors if name != skip))

rollout.HFEngine.update_weights = update_weights
isotrain.cli.main(sys.argv[1:])
"""


def test_a_sync_that_leaves_one_tensor_stale_stops_the_run_before_training_on_it(tmp_path):
    from helpers import assert_clean_error
    from test_async_rl import ASYNC, metrics
    from zygote import run_forked_ranks

    script = tmp_path / "stale_norm.py"
    script.write_text(STALE_NORM)
    run_dir = tmp_path / "run"
    proc = run_forked_ranks(1, ["rl", *ASYNC, "rollout.engine=hf", "rl.max_off_policy_steps=0", "train.max_steps=3",
                                f"output_dir={run_dir}"], script=script)
    assert_clean_error(proc, "after the update of step 1, the rollout engine's weights differ from the trainer's in "
                             "1 of 21 tensors (e.g. model.norm.weight): it would sample with stale or corrupted "
                             "weights, so the run stops before training on them")
    # step 1's own sync failed: no step 2 was generated on the stale engine, no model was written
    assert metrics(run_dir) == [] and not (run_dir / "model").exists()
