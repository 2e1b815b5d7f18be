"""What can be checked about the model before any work: its transformers config parses, it is a causal LM with
sensible sizes, and its positions hold the run's sequences. Each failure is one sentence naming the setting."""

from __future__ import annotations

import json
from pathlib import Path

from isotrain.errors import ConfigError

# Sizes that must be at least 1 where a config has them (transformers accepts 0 or -1 and builds a broken model).
_POSITIVE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "max_position_embeddings", "head_dim", "num_local_experts", "num_experts",
             "num_experts_per_tok")


def read_config_json(directory: Path) -> dict:
    """config.json of a model directory as a mapping; a broken file is named as such (not as a tokenizer)."""
    path = directory / "config.json"
    try:
        mapping = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fix the file or re-save the model with "
                          "save_pretrained") from None
    if not isinstance(mapping, dict) or "model_type" not in mapping:
        raise ConfigError(f"{path} has no model_type entry; it is not a transformers model config: re-save the "
                          "model with save_pretrained")
    return mapping


def config_from_mapping(model_type: str, mapping: dict, where: str):
    """`AutoConfig.for_model`, with transformers' own validation failures turned into one sentence."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **mapping)
    except StrictDataclassError as err:
        reason = str(err.__cause__ or err).strip().rstrip(".")
        reason = reason[:1].lower() + reason[1:]
        raise ConfigError(f"{where} is invalid: {reason}; fix {where}") from None
    except (ValueError, TypeError) as err:
        if model_type not in _model_types():
            raise ConfigError(f"{_named('model_type', repr(model_type), where)} is not a transformers model type; "
                              "use e.g. llama, qwen2 or qwen3") from None
        raise ConfigError(f"{where} is invalid: {err}; fix {where}") from None


def _model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def check_causal_lm(config, where: str) -> None:
    """A model isotrain trains must be a decoder: causal attention and a causal-LM class in transformers."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model_type {model_type!r} of {where} has no causal-LM class in transformers; isotrain "
                          "trains causal LMs: use a decoder model type such as llama, qwen2 or qwen3")
    # Encoders (BERT, RoBERTa, ...) have a causal-LM class, but attend both ways unless configured as a decoder.
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ConfigError(f"model_type {model_type!r} of {where} is an encoder whose attention sees later tokens, "
                          "so it would not learn to predict the next token; use a decoder model type such as llama, "
                          "qwen2 or qwen3")


def check_sizes(config, where: str, explicit: dict) -> None:
    """Every size at least 1, and the attention heads splitting the hidden size (unless head_dim is given)."""
    for name in _POSITIVE:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{_named(name, value, where)} is invalid; set it to at least 1")
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and explicit.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{_named('hidden_size', hidden, where)} is not divisible by num_attention_heads={heads}; "
                          "choose a number of heads that divides the hidden size")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(f"{_named('num_attention_heads', heads, where)} is not divisible by num_key_value_heads="
                          f"{kv_heads}; choose a number of key/value heads that divides the number of heads")


def _named(field: str, value, where: str) -> str:
    """`model.config.x=1` for a fresh model's mapping, `x=1 in <dir>/config.json` for a model directory."""
    return f"{where}.{field}={value}" if where == "model.config" else f"{field}={value} in {where}"


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings or RoPE settings are made for, if it says."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def fit_max_seq_len(max_seq_len: int, explicit: bool, config, where: str, fresh: bool) -> int:
    """`data.max_seq_len` within the model's positions: an `explicit` value beyond them is refused; the default
    (512) is lowered to the model's positions, so a small model works without setting it."""
    positions = max_positions(config)
    if positions is None or max_seq_len <= positions:
        return max_seq_len
    if not explicit:
        return positions
    fix = "raise model.config.max_position_embeddings" if fresh else "use a model made for longer sequences"
    raise ConfigError(f"data.max_seq_len={max_seq_len} is more than the {positions} positions of {where} "
                      f"(max_position_embeddings); lower data.max_seq_len to at most {positions} or {fix}")


def attention_kernel(requested: str | None, config, model_class) -> str:
    """`requested` (model.attn_implementation), or sdpa where the architecture has it and eager where not
    (e.g. Gemma2). `varlen` (models/varlen.py) is sdpa with packed rows through flash's variable-length kernel,
    registered with transformers under its own name."""
    try:
        supports_sdpa = model_class._model_mapping[type(config)]._supports_sdpa
    except (AttributeError, KeyError):
        supports_sdpa = True  # let transformers decide and say so
    if requested is None:
        return "sdpa" if supports_sdpa else "eager"
    if requested in ("sdpa", "varlen") and not supports_sdpa:
        raise ConfigError(f"model.attn_implementation='{requested}' is not supported by {config.model_type} models "
                          "in transformers; set model.attn_implementation=eager or leave it unset")
    if requested == "varlen":
        from transformers import AutoModel

        from isotrain.models import varlen

        if model_class is AutoModel:
            raise ConfigError("model.attn_implementation=varlen runs packed causal-LM rows (isotrain train and rl), "
                              "not an embedding encoder; set model.attn_implementation=sdpa or leave it unset")

        varlen.check(config)
        return varlen.register()
    return requested


def check_prompt_room(tokenizer, prompts: list[str], max_new_tokens: int, budget: str, limit: int, limit_text: str,
                      source: str) -> None:
    """Every prompt (bos + its tokens, as generation encodes it) plus `max_new_tokens` fits in `limit` tokens:
    past it a model with learned positions fails mid-run and a RoPE model runs beyond what it was made for."""
    if not prompts:
        return
    bos = 1 if tokenizer.bos_token_id is not None else 0
    lengths = [bos + len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(prompts)), key=lengths.__getitem__)
    n = lengths[longest]
    if n + max_new_tokens > limit:
        shown = prompts[longest] if len(prompts[longest]) <= 40 else prompts[longest][:40] + "..."
        raise ConfigError(f"the prompt {shown!r} of {source} has {n} tokens, and with {budget}={max_new_tokens} "
                          f"its sequence reaches {n + max_new_tokens}, more than {limit_text}; lower {budget} or "
                          "remove the longest prompts")
