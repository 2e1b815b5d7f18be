"""A resume hands back the checkpoint's own values of the recipe's extra state (`Resumed.extra_state`), read
from its train_state/state.json by the engine, so a recipe compares them without reading the file itself."""

from __future__ import annotations

import torch

from isotrain.checkpoint.manager import SFT_COUNTERS, CheckpointContract, CheckpointManager
from isotrain.config import build_config
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.train.optim import build_optimizer

TINY = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


def manager(tmp_path, start_model: str) -> CheckpointManager:
    cfg = build_config({"output_dir": str(tmp_path), "model": {"config": TINY}, "tokenizer": {"type": "char"},
                        "train": {"max_steps": 2, "global_batch_size": 1, "micro_batch_size": 1},
                        "eval": {"path": None}})
    tokenizer = train_tokenizer(["abcdef 0123456789"], "char", cfg.tokenizer.vocab_size)
    model = build_plain(cfg.model, tokenizer, seed=0)
    contract = CheckpointContract(extra_state={
        "sampler": {"global_batch_size": 1, "seed": 0, "num_samples": 4}, "data_fingerprint": "d",
        "tokenizer_sha256": "t", "start_model_sha256": start_model})
    return CheckpointManager(cfg, 0, 1, {"world_size": 1}, model, build_optimizer(model, cfg.train), tokenizer,
                             contract, log=lambda *a: None)


def test_resumed_carries_the_saved_extra_state(tmp_path):
    first = manager(tmp_path, start_model="old")
    for param in first.model.parameters():  # one optimizer step, so there is optimizer state to save
        param.grad = torch.zeros_like(param)
    first.optimizer.step()
    first.save(2, {key: 3 for key in SFT_COUNTERS})
    first.wait()
    resumed = manager(tmp_path, start_model="new").resume()
    assert resumed is not None and resumed.step == 2
    # the checkpoint's values, not the current run's contract
    assert resumed.extra_state["start_model_sha256"] == "old"
    assert resumed.extra_state["sampler"] == {"global_batch_size": 1, "seed": 0, "num_samples": 4}
