"""The embedding model: a Hugging Face base model (encoder or decoder LM, no head), its tokenizer, and the
checks that its pooling and Matryoshka sizes make sense for it."""

from __future__ import annotations

import torch
from transformers import AutoModel

from isotrain.embed.dropout import checkpoint_contexts
from isotrain.embed.encode import EncodeOptions
from isotrain.errors import ConfigError
from isotrain.models.build import build
from isotrain.models.loading import model_config
from isotrain.models.loading import tokenizer_dir
from isotrain.models.tokenizer import add_special_tokens, load_tokenizer, train_tokenizer
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import ParallelState, single_process


def is_decoder_lm(config) -> bool:
    """A model whose attention is causal: every architecture without a masked-LM (bidirectional) form."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def check_embedder(config, pooling: str, matryoshka_dims: list[int]) -> None:
    if pooling == "cls" and is_decoder_lm(config):
        raise ConfigError(f"embed.pooling='cls' cannot embed with {config.model_type!r}, a causal decoder whose "
                          "first token sees no other token; use embed.pooling=last or mean")
    too_large = [d for d in matryoshka_dims if d > config.hidden_size]
    if too_large:
        raise ConfigError(f"embed.matryoshka_dims {too_large} exceed the model's hidden size {config.hidden_size}; "
                          f"use sizes up to {config.hidden_size}")


def embed_tokenizer(cfg, texts, info, output_dir, log):
    """The model's (or tokenizer.path's) tokenizer with `model.add_special_tokens` added (the model is then
    built with that many rows); a fresh model without one gets a tokenizer trained on `texts` by rank 0 into
    <output_dir>/tokenizer (kept: a resumed run loads it), which the other ranks then load."""
    tokenizer = _base_tokenizer(cfg, texts, info, output_dir, log)
    added = add_special_tokens(tokenizer, cfg.model.add_special_tokens)
    if added:
        log(f"added {added} special tokens; embeddings are resized to {len(tokenizer)}")
    return tokenizer


def _base_tokenizer(cfg, texts, info, output_dir, log):
    from isotrain.train.setup import rank0_first

    source = tokenizer_dir(cfg)
    if source is not None:
        return load_tokenizer(str(source))
    trained_dir = output_dir / "tokenizer"

    def train_and_save():
        if info.is_main and not (trained_dir / "tokenizer_config.json").is_file():
            trained = train_tokenizer(texts, cfg.tokenizer.type, cfg.tokenizer.vocab_size)
            trained.save_pretrained(trained_dir)
            log(f"trained a {cfg.tokenizer.type} tokenizer ({len(trained)} tokens) -> {trained_dir}")
        return load_tokenizer(str(trained_dir))

    return rank0_first(info, train_and_save)


def check_embed_layout(dims: ParallelDims) -> None:
    """Data parallelism, replicated or sharded by FSDP2 (parallel.dp_replicate, parallel.dp_shard): the GradCache
    step gathers embeddings over the DP group only, so a model split by TP or EP is refused."""
    if dims.tp > 1 or dims.ep > 1:
        raise ConfigError(f"isotrain embed runs data parallel only, replicated or sharded by FSDP2 (got parallel.tp="
                          f"{dims.tp}, ep={dims.ep}); set parallel.tp=1 and parallel.ep=1 and use parallel.dp_shard "
                          "or parallel.dp_replicate")


def check_embed_settings(cfg) -> None:
    """Settings of the shared train section that isotrain embed cannot honour are refused, never ignored."""
    if cfg.train.compile:
        raise ConfigError("train.compile=true is not supported by isotrain embed yet (its per-text dropout masks "
                          "cannot be traced by torch.compile); set train.compile=false")


def build_embedder(cfg, tokenizer, device: torch.device, parallel: ParallelState | None = None) -> torch.nn.Module:
    """The base model for this rank's layout, identical everywhere (same seed or same files); training mode so
    that dropout follows the model's config.

    model.dtype=bfloat16: fp32 master weights, which FSDP2 casts to bf16 for compute (its mixed-precision policy,
    gradients reduced in fp32); without FSDP2 the forwards autocast instead (`encode_options`).
    train.activation_checkpointing=full: every encoder layer is recomputed in backward, with the keyed dropout
    masks of its forward (embed/dropout.py `checkpoint_contexts`).

    With FSDP2 (`parallel.dims.fsdp`) each rank holds its shard, and FSDP2's reduce-scatter sums the gradients
    (divide factor 1). Otherwise every rank holds the whole model and no DDP wrapper is applied: the GradCache
    step sums the gradients itself (gradcache.py), since its backwards are not one per micro-batch."""
    from isotrain.train.setup import compute_dtype

    check_embed_settings(cfg)
    config = model_config(cfg.model, tokenizer)
    check_embedder(config, cfg.embed.pooling, cfg.embed.matryoshka_dims)
    if parallel is None or not parallel.dims.fsdp:
        parallel = single_process(ParallelDims(1, 1, 1))
    model = build(cfg.model, tokenizer, cfg.train.seed, parallel, device, model_class=AutoModel,
                  compute_dtype=compute_dtype(cfg), activation_checkpointing=cfg.train.activation_checkpointing == "full",
                  checkpoint_context_fn=checkpoint_contexts)
    freeze_pooler(model)
    return model


def freeze_pooler(model: torch.nn.Module) -> None:
    """An encoder's pooler head (BERT's tanh layer on [CLS]) is not part of any pooling here: it gets no
    gradient, so it is frozen (kept as loaded, saved as is) rather than left without optimizer state."""
    if getattr(model, "pooler", None) is not None:
        model.pooler.requires_grad_(False)


def encode_options(cfg, tokenizer, fsdp: bool) -> EncodeOptions:
    """How the run turns texts into vectors (embed/encode.py), from its config and tokenizer; `fsdp`: whether FSDP2
    shards the model."""
    # bf16: FSDP2 casts the parameters it gathers (parallel/apply.py); otherwise autocast casts them per op.
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and not fsdp else None
    return EncodeOptions(cfg.embed.pooling, tokenizer.pad_token_id, tokenizer.padding_side, cfg.embed.chunk_tokens,
                         cfg.train.seed, autocast_dtype=autocast)
