"""Where a run's model comes from, its transformers config, and the checks that can run on it before any work. The
model itself is built by models/build.py.

`model.name_or_path` and `tokenizer.path` name local directories: each a local path as given, or a Hugging Face Hub
id resolved to its cached snapshot (isotrain/hub.py). Every reader of those fields (config checks, tokenizer,
weights, memory estimate, RL's start fingerprint) asks `model_dir` / `tokenizer_dir` here, so a Hub id works
wherever a directory does, and the config keeps the id the user wrote (config.yaml, an adapter's
`base_model_name_or_path`). A run fetches its files once per machine before any reader (`fetch_run_files`); a dry
run (`config show`, `estimate-memory`) fetches the small files only (`need="config"`). The config is read from such
a directory or from a config mapping.

Parameters are always created in fp32: they are the master weights. `model.dtype=bfloat16`
is applied as compute dtype by the trainer (autocast or FSDP2's mixed-precision policy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM

from isotrain.config import ModelConfig, RunConfig
from isotrain.errors import ConfigError
from isotrain.hub import CONFIG_FILES, MODEL_FILES, TOKENIZER_FILES, is_hub_id, resolve
from isotrain.models.checks import (
    attention_kernel,
    check_causal_lm,
    check_sizes,
    config_from_mapping,
    fit_max_seq_len,
    read_config_json,
)
from isotrain.parallel.dist import local_main_first


# "config": config.json and the tokenizer's files (checks, sizes, estimates); "weights": those and the weights.
Need = Literal["config", "weights"]
_PATTERNS = {"config": (*CONFIG_FILES, *TOKENIZER_FILES), "weights": MODEL_FILES}


def model_dir(cfg: ModelConfig, need: Need = "weights", local_only: bool = False) -> Path:
    """The local directory of `model.name_or_path` (which must be set). A Hub snapshot fetched for its weights
    must hold them: a cache filled for a dry run (config.json only) is not taken for a model."""
    directory = resolve(cfg.name_or_path, cfg.revision, field="model.name_or_path", revision_field="model.revision",
                        allow_patterns=_PATTERNS[need], local_only=local_only)
    if need == "weights" and is_hub_id(cfg.name_or_path) and not any(directory.glob("model*.safetensors")):
        raise ConfigError(f"model.name_or_path={cfg.name_or_path!r} is in the Hugging Face cache ({directory}) without "
                          "model*.safetensors weights (isotrain reads safetensors only); run once with network access "
                          "to download them, or give a local model directory")
    return directory


def tokenizer_dir(cfg: RunConfig, local_only: bool = False) -> Path | None:
    """The local directory of the run's tokenizer: `tokenizer.path`, else the model's; None for a fresh model
    without one (a tokenizer is then trained)."""
    if cfg.tokenizer.path is not None:
        return resolve(cfg.tokenizer.path, cfg.tokenizer.revision, field="tokenizer.path",
                       revision_field="tokenizer.revision", allow_patterns=(*CONFIG_FILES, *TOKENIZER_FILES),
                       local_only=local_only)
    if cfg.tokenizer.revision is not None:
        raise ConfigError(f"tokenizer.revision={cfg.tokenizer.revision!r} applies to a tokenizer.path Hub id, and "
                          "tokenizer.path is not set; remove tokenizer.revision (model.revision selects the model's "
                          "tokenizer too)")
    if cfg.model.name_or_path is None:
        return None
    return model_dir(cfg.model, "config", local_only)


def fetch_run_files(cfg: RunConfig, need: Need, local_rank: int) -> None:
    """Resolve the run's model files (`need`) and tokenizer files, downloading what is missing from the Hub on each
    machine's local rank 0 first; the machine's other ranks then read its cache only. Local paths are left as
    they are. Called by the run session before any reader."""

    def fetch(first: bool) -> None:
        if cfg.model.name_or_path is not None:
            model_dir(cfg.model, need, local_only=not first)
        tokenizer_dir(cfg, local_only=not first)

    local_main_first(local_rank, fetch)


def _mapping_config(cfg: ModelConfig):
    """The transformers config `model.config` describes, before the tokenizer has a say."""
    mapping = dict(cfg.config)
    return config_from_mapping(mapping.pop("model_type"), mapping, "model.config")


def _fresh_config(cfg: ModelConfig, tokenizer):
    config = _mapping_config(cfg)
    # The tokenizer decides the vocabulary unless the config asks for more rows (e.g. padding to 64).
    config.vocab_size = max(cfg.config.get("vocab_size") or 0, len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    return config


def check_model_dir(cfg: ModelConfig) -> Path:
    """The local directory of `model.name_or_path` (a Hub id resolved to its cached snapshot: `model_dir`),
    which must hold config.json."""
    path = model_dir(cfg, "config")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path!r} is not a model directory with config.json; "
            "pass a local Hugging Face model directory or a Hugging Face Hub id"
        )
    return path


def _directory_config(cfg: ModelConfig):
    path = check_model_dir(cfg)
    mapping = read_config_json(path)
    mapping.pop("transformers_version", None)
    config = config_from_mapping(mapping.pop("model_type"), mapping, f"{path / 'config.json'}")
    config.name_or_path = str(path)
    return config


def checked_config(cfg: RunConfig):
    """Before any work: the run's model config parses, is a causal LM with valid sizes, and its positions hold
    `data.max_seq_len` (the default is lowered to fit). Returns the transformers config (vocabulary not yet
    grown for the tokenizer)."""
    fresh = cfg.model.name_or_path is None
    config = _mapping_config(cfg.model) if fresh else _directory_config(cfg.model)
    where = "model.config" if fresh else f"the model in {cfg.model.name_or_path!r}"
    check_causal_lm(config, where)
    # A directory's config.json may set head_dim so that heads × head_dim differs from the hidden size (Gemma).
    explicit = cfg.model.config if fresh else {"head_dim": getattr(config, "head_dim", None)}
    check_sizes(config, "model.config" if fresh else f"{Path(config.name_or_path) / 'config.json'}", explicit)
    data = cfg.data
    data.max_seq_len = fit_max_seq_len(data.max_seq_len, "max_seq_len" in data.model_fields_set, config, where, fresh)
    attention_kernel(cfg.model.attn_implementation, config, AutoModelForCausalLM)
    return config


def declared_config(cfg: ModelConfig):
    """The transformers config of `model.config` or of the directory's config.json, unchecked (any family)."""
    return _mapping_config(cfg) if cfg.name_or_path is None else _directory_config(cfg)


def check_layout_fits(cfg: ModelConfig, dims) -> None:
    """Before any work: the model's heads, KV heads and MLP width split over `parallel.tp`, and the family has
    a tensor-parallel plan; under expert parallelism, the model has experts and `parallel.ep` divides their number;
    under pipeline parallelism, it has a decoder layer per stage.
    (The vocabulary, known once the tokenizer exists, is checked when building.)"""
    if dims.tp == 1 and dims.ep == 1 and dims.cp == 1 and dims.pp == 1:
        return
    from isotrain.parallel.dims import check_model_fits
    from isotrain.parallel.tp import layer_plan

    if dims.cp > 1 and cfg.attn_implementation not in (None, "sdpa"):
        raise ConfigError(f"parallel.cp={dims.cp} runs its own attention over SDPA, not "
                          f"model.attn_implementation={cfg.attn_implementation}; leave model.attn_implementation "
                          "unset or set it to sdpa")
    config = declared_config(cfg)
    # A fresh model's vocabulary is not known before the tokenizer exists; the builder checks it.
    check_model_fits(dims, config, check_vocab=cfg.name_or_path is not None)
    if dims.tp > 1:
        layer_plan(config)


def model_config(cfg: ModelConfig, tokenizer):
    """The transformers config of the run's model: the directory's own, or a fresh one from `model.config`.

    A tokenizer with more tokens than the model's vocabulary (added special tokens) grows the vocabulary;
    the loader initialises the new embedding rows.
    """
    if cfg.name_or_path is None:
        return _fresh_config(cfg, tokenizer)
    config = _directory_config(cfg)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    return config


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
