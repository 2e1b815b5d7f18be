"""Where a run's model and tokenizer files are: `model.name_or_path` and `tokenizer.path` as local directories,
each a local path as given or a Hugging Face Hub id resolved to its cached snapshot (isotrain/hub.py).

Every reader of those fields (config checks, tokenizer, weights, memory estimate, RL's start fingerprint) asks
here, so a Hub id works wherever a directory does, and the config keeps the id the user wrote (config.yaml, an
adapter's `base_model_name_or_path`). A run fetches its files once per machine before any reader
(`fetch_run_files`); a dry run (`config show`, `estimate-memory`) fetches the small files only (`need="config"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from isotrain.config import ModelConfig, RunConfig
from isotrain.errors import ConfigError
from isotrain.hub import CONFIG_FILES, MODEL_FILES, TOKENIZER_FILES, is_hub_id, resolve
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
