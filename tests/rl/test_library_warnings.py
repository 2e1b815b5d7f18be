"""Our calls into transformers and peft use their current names: a deprecation warning from them
lands in the user's terminal (and between a run's error sentence and its exit) on every run."""

from __future__ import annotations

import warnings

import pytest
import torch
import engine_models

from isotrain.models.lora import apply_lora
from isotrain.parallel.apply import apply_activation_checkpointing
from isotrain.rl.decode import sample


@pytest.fixture
def model():
    return engine_models.tiny_model(engine_models.digits_tokenizer())


@pytest.fixture(autouse=True)
def future_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


def test_sampling_with_the_kv_cache(model):
    tokens, _ = sample(model.eval(), torch.tensor([[1, 4, 5]]), torch.ones(1, 3, dtype=torch.long),
                       max_new_tokens=3, eos_id=-1, pad_id=0, greedy=True)
    assert tokens.shape == (1, 3)


def test_activation_checkpointing(model):
    apply_activation_checkpointing(model)
    model.train()
    model(input_ids=torch.tensor([[1, 4, 5]]), labels=torch.tensor([[1, 4, 5]])).loss.backward()


def test_lora(model):
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
