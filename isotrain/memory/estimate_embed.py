"""Per-rank memory of an `isotrain embed` run, from its config alone: the encoder's model states (memory/estimate.py,
the model isotrain embed builds: AutoModel, fp32 weights, the pooler frozen) and the GradCache step's own terms
(memory/embed_step.py): one forward with gradient at a time, the vectors and gradient cache the step keeps, and the
global batch's contrastive loss.

model.dtype (or --dtype) bfloat16 computes as the recipe does: FSDP2's bf16 parameter copies in its buffers under
dp_shard, else autocast's bf16 weight copies (`compute copies`) kept by each forward with gradient; the vectors, the
gradient cache and the loss keep their precision (fp32, fp64). train.activation_checkpointing=full keeps each encoder
layer's input instead of its activations, and one layer's activations rebuilt in backward (`recomputed layer`).
"""

from __future__ import annotations

from isotrain.config import EmbedRunConfig
from isotrain.errors import ConfigError
import torch

from isotrain.memory.estimate import (DTYPES, MemoryEstimate, Term, default_device, fsdp_terms, model_state_terms,
                                      run_vocab_size)



def _meta_encoder(cfg: EmbedRunConfig, config):
    import torch
    from transformers import AutoModel

    from isotrain.embed.model import freeze_pooler
    from isotrain.models.checks import attention_kernel

    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=torch.float32,
                                      attn_implementation=attention_kernel(cfg.model.attn_implementation, config,
                                                                           AutoModel))
    freeze_pooler(model)
    return model


def step_terms(cfg: EmbedRunConfig, config, degrees, dtype: str, device: str) -> list[Term]:
    from isotrain.embed.loss import LossSettings
    from isotrain.memory.embed_step import EmbedShapes, fake_loss_bytes, kept_vector_bytes
    from isotrain.memory.fake_forward import fake_encode
    from isotrain.models.checks import attention_kernel
    from transformers import AutoModel

    global_samples = cfg.train.global_batch_size
    shapes = EmbedShapes(global_samples, cfg.embed.hard_negatives or 0, global_samples // degrees.dp_size,
                         cfg.train.micro_batch_size, cfg.data.max_seq_len, config.hidden_size, cfg.embed.chunk_tokens)
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModel)
    _, compute = DTYPES[dtype]
    lowp = compute != torch.float32
    checkpointing = cfg.train.activation_checkpointing == "full"
    kwargs = dict(num_texts=shapes.texts_per_forward, seq_len=shapes.seq_len, pooling=cfg.embed.pooling,
                  device=device, param_dtype=compute if degrees.fsdp else torch.float32,
                  autocast_dtype=compute if lowp and not degrees.fsdp else None)
    forward = fake_encode(config, kernel, activation_checkpointing=checkpointing, **kwargs)
    settings = LossSettings(cfg.embed.temperature, cfg.embed.symmetric, tuple(cfg.embed.matryoshka_dims),
                            cfg.embed.mask_duplicates)
    loss = fake_loss_bytes(shapes, settings)
    documents = shapes.global_samples * (1 + shapes.negatives)
    local_texts = shapes.local_samples * shapes.texts_per_sample
    chunk = f"at most {cfg.embed.chunk_tokens} padded tokens" if cfg.embed.chunk_tokens else "no embed.chunk_tokens"
    terms = [Term("activations", forward.by_kind["activations"],
                  f"one forward with gradient of {shapes.texts_per_forward} texts × {shapes.seq_len} tokens ({chunk}; "
                  f"GradCache re-embeds a forward at a time), {dtype}, dropout keyed per text"
                  + (", encoder layer inputs only (checkpointing)" if checkpointing else "")),
             Term("compute copies", forward.by_kind["compute_copies"], "autocast's bf16 weight copies, kept by one "
                  "forward with gradient" if lowp and not degrees.fsdp else "none (no autocast)"),
             Term("embeddings and gradient cache", kept_vector_bytes(shapes),
                  f"the {local_texts} local texts' fp32 vectors twice (embedded, split), their gradient cache, one "
                  "micro-batch's cache rows, text ids"),
             Term("contrastive loss", loss.total,
                  f"global batch, fp64, on every rank: {shapes.global_samples} queries × {documents} documents; "
                  "the gathered vectors, the loss's saved log-softmax and mask, the similarity's gradient, the "
                  "vectors' gradients (before the forwards with gradient, not beside them)")]
    if checkpointing:
        full = fake_encode(config, kernel, activation_checkpointing=False, **kwargs)
        body = lambda s: s.by_kind["activations"] + s.by_kind["compute_copies"]  # noqa: E731
        terms.append(Term("recomputed layer", max(0, body(full) - body(forward)) // config.num_hidden_layers,
                          "one encoder layer's activations, rebuilt in backward"))
    return terms


def estimate_embed_memory(cfg: EmbedRunConfig, world_size: int, dtype: str | None = None,
                          vocab_size: int | None = None, device: str | None = None) -> MemoryEstimate:
    """Every term of one rank's memory (rank 0) of `isotrain embed` with `cfg` on `world_size` processes, computing
    in `dtype` (default: model.dtype)."""
    from isotrain.embed.model import check_embed_layout, check_embed_settings, check_embedder
    from isotrain.models.loading import declared_config
    from isotrain.parallel.dims import check_model_fits, resolve_dims

    dtype = dtype or cfg.model.dtype
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} cannot be estimated; use cpu or cuda")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype {dtype} cannot be estimated for isotrain embed, which computes in model.dtype "
                          "(float32 or bfloat16); pass --dtype float32 or --dtype bfloat16")
    check_embed_settings(cfg)
    degrees = resolve_dims(cfg.parallel, world_size)
    check_embed_layout(degrees)
    config = declared_config(cfg.model)
    check_embedder(config, cfg.embed.pooling, cfg.embed.matryoshka_dims)
    how = "given"
    if vocab_size is None:
        vocab_size, how = run_vocab_size(cfg, config)
    config.vocab_size = vocab_size
    check_model_fits(degrees, config)
    model = _meta_encoder(cfg, config)
    settings = {"world_size": world_size, **dict(degrees.as_rows()), "dtype": dtype, "device": device,
                "micro_batch_size": cfg.train.micro_batch_size, "max_seq_len": cfg.data.max_seq_len,
                "activation_checkpointing": cfg.train.activation_checkpointing,
                "global_batch_size": cfg.train.global_batch_size, "hard_negatives": cfg.embed.hard_negatives or 0,
                "chunk_tokens": cfg.embed.chunk_tokens, "vocab_size": vocab_size, "vocab_size_source": how,
                "step": "embed", "parameters": sum(p.numel() for p in model.parameters())}
    not_counted = ["the no-gradient forwards' transient activations (one layer at a time)"]
    if degrees.dp_size > 1 and not degrees.fsdp:
        not_counted.append("the flat fp32 copy of the gradients that sums them over replicas at the end of the step")
    if cfg.embed.hard_negatives is None:
        not_counted.append("hard negatives (embed.hard_negatives unset: 0 assumed; the run takes the fewest a data "
                           "row carries)")
    settings["not_counted"] = "; ".join(not_counted)
    terms = [*model_state_terms(model, config, degrees, dtype), *fsdp_terms(model, config, degrees, dtype),
             *step_terms(cfg, config, degrees, dtype, device)]
    return MemoryEstimate(settings, terms)
