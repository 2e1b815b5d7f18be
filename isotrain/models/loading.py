"""Build a causal LM from a local Hugging Face directory or from a config mapping, in fp32.

Parameters are always created in fp32: they are the master weights. `model.dtype=bfloat16`
is applied as compute dtype by the trainer (autocast or FSDP2's mixed-precision policy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from isotrain.config import ModelConfig
from isotrain.errors import ConfigError


def _fresh_config(cfg: ModelConfig, tokenizer):
    mapping = dict(cfg.config)
    model_type = mapping.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **mapping)
    except ValueError:
        raise ConfigError(
            f"model.config.model_type={model_type!r} is not a transformers model type; use e.g. llama, qwen2 or qwen3"
        ) from None
    # The tokenizer decides the vocabulary unless the config asks for more rows (e.g. padding to 64).
    config.vocab_size = max(mapping.get("vocab_size") or 0, len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    return config


def check_model_dir(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.name_or_path={name_or_path!r} is not a model directory with config.json; "
            "pass a local Hugging Face model directory"
        )
    return path


def build_model(cfg: ModelConfig, tokenizer, seed: int) -> PreTrainedModel:
    if cfg.name_or_path is not None:
        path = check_model_dir(cfg.name_or_path)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the run's own log says what was loaded
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=cfg.attn_implementation, local_files_only=True
        )
    else:
        config = _fresh_config(cfg, tokenizer)
        # Seeded here so that every rank initialises identical weights before sharding.
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=cfg.attn_implementation
            )
        except ValueError as err:
            raise ConfigError(f"model.config cannot build a causal LM: {err}") from None
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        # New special tokens: rows initialised from the mean of the old ones (seeded, same on all ranks).
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer))
    model.config.use_cache = False
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
