"""Checkpoints are Hugging Face model directories, and Hugging Face directories start runs."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from isotrain.config import load_config
from isotrain.data import prepare_dataset
from isotrain.data.collate import collate
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.train.loss import token_losses
from isotrain.recipes.sft import train

SMALL = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.deterministic=true",
    "logging.progress=false",
    "eval.path=null",
]


def test_a_checkpoint_loads_in_transformers_with_the_training_logits(tmp_path):
    cfg = load_config(None, [*SMALL, "train.max_steps=3", "checkpoint.every_steps=3", f"output_dir={tmp_path}"])
    result = train(cfg)
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = torch.tensor([tokenizer.encode("12+34=46")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, result.model(ids).logits)
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_directory_saved_by_transformers_starts_a_run(tmp_path):
    # The tokenizer of a first run, and a model made by transformers alone with a known first loss.
    first = load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={tmp_path / 'first'}"])
    train(first)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "first" / "tokenizer")
    torch.manual_seed(123)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    source = tmp_path / "hf"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)

    overrides = [o for o in SMALL if not o.startswith("model.config")]
    cfg = load_config(None, [*overrides, "model.config=null", f"model.name_or_path={source}", "train.max_steps=1",
                             f"output_dir={tmp_path / 'second'}"])
    train(cfg)
    # The first step's loss is the source model's own loss on global batch 0: its weights were used.
    row = json.loads((tmp_path / "second" / "metrics.jsonl").read_text().splitlines()[0])
    samples = _dataset(cfg, tokenizer)
    batch = GlobalBatchSampler(len(samples), 16, cfg.train.seed).global_batch(0)
    mb = collate([samples[i] for i in batch], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
    losses = token_losses(logits, mb["labels"])
    expected = float(losses.sum() / (mb["labels"] != -100).sum())
    assert abs(row["loss"] - expected) <= 1e-5 * expected


def _dataset(cfg, tokenizer):
    return prepare_dataset(cfg.data, tokenizer, log=lambda *a, **k: None).samples
