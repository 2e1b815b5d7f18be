"""model.add_special_tokens through a real run: the vocabulary grows, checkpoints carry it, a resume keeps it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from helpers import model_weights
from isotrain.config import load_config
from isotrain.recipes.sft import train

SMALL = [
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.deterministic=true",
    "logging.progress=false",
    "eval.path=null",
    "checkpoint.every_steps=1",
]
ADDED = ["<tool>", "<call>"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A Hugging Face directory (weights + tokenizer) without the new tokens."""
    root = tmp_path_factory.mktemp("special")
    train(load_config(None, ["model.config.hidden_size=32", "model.config.intermediate_size=64",
                             "model.config.num_hidden_layers=2", *SMALL, "checkpoint.every_steps=0",
                             "train.max_steps=1", f"output_dir={root / 'first'}"]))
    tokenizer = AutoTokenizer.from_pretrained(root / "first" / "tokenizer")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    return root / "hf", len(tokenizer)


def _config(source_dir, output_dir, steps: int):
    return load_config(None, [*SMALL, "model.config=null", f"model.name_or_path={source_dir}",
                              f"model.add_special_tokens={json.dumps(ADDED)}", f"train.max_steps={steps}",
                              f"output_dir={output_dir}"])


def test_added_tokens_grow_the_model_reach_the_checkpoint_and_survive_a_resume(source, tmp_path):
    source_dir, old_size = source
    train(_config(source_dir, tmp_path / "straight", 2))
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-00000002"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert len(tokenizer) == old_size + 2
    assert [tokenizer.convert_tokens_to_ids(t) for t in ADDED] == [old_size, old_size + 1]
    assert tokenizer.encode("<tool>", add_special_tokens=False) == [old_size]
    assert json.loads((checkpoint / "config.json").read_text())["vocab_size"] == old_size + 2
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert loaded.get_input_embeddings().weight.shape[0] == old_size + 2

    # Stopped after step 1 and resumed: the resume neither adds the tokens again nor redraws their rows.
    train(_config(source_dir, tmp_path / "resumed", 1))
    train(_config(source_dir, tmp_path / "resumed", 2))
    resumed = tmp_path / "resumed" / "checkpoints" / "step-00000002"
    assert len(AutoTokenizer.from_pretrained(resumed)) == old_size + 2
    expected, got = model_weights(checkpoint), model_weights(resumed)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
