"""Per-rank memory of an `isotrain embed` run, from its config alone: the encoder's model states (memory/estimate.py,
the model isotrain embed builds: AutoModel, fp32, the pooler frozen) and the GradCache step's own terms
(memory/embed_step.py): one forward with gradient at a time, the vectors and gradient cache the step keeps, and the
global batch's contrastive loss.

isotrain embed builds its model in fp32 and applies neither model.dtype nor train.activation_checkpointing (nor
train.compile), so the estimate computes in fp32 without checkpointing whatever those say, and says so.
"""

from __future__ import annotations

from isotrain.config import EmbedRunConfig
from isotrain.errors import ConfigError
from isotrain.memory.estimate import (MemoryEstimate, Term, default_device, fsdp_terms, model_state_terms,
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


def _not_applied(cfg: EmbedRunConfig) -> list[str]:
    """Settings of the config that isotrain embed does not apply (so neither does the estimate)."""
    ignored = []
    if cfg.model.dtype != "float32":
        ignored.append(f"model.dtype={cfg.model.dtype}")
    if cfg.train.activation_checkpointing != "none":
        ignored.append(f"train.activation_checkpointing={cfg.train.activation_checkpointing}")
    return ignored


def step_terms(cfg: EmbedRunConfig, config, degrees, device: str) -> list[Term]:
    from isotrain.embed.loss import LossSettings
    from isotrain.memory.embed_step import EmbedShapes, fake_loss_bytes, kept_vector_bytes
    from isotrain.memory.fake_forward import fake_encode
    from isotrain.models.checks import attention_kernel
    from transformers import AutoModel

    global_samples = cfg.train.global_batch_size
    shapes = EmbedShapes(global_samples, cfg.embed.hard_negatives or 0, global_samples // degrees.dp_size,
                         cfg.train.micro_batch_size, cfg.data.max_seq_len, config.hidden_size, cfg.embed.chunk_tokens)
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModel)
    forward = fake_encode(config, kernel, num_texts=shapes.texts_per_forward, seq_len=shapes.seq_len,
                          pooling=cfg.embed.pooling, device=device)
    settings = LossSettings(cfg.embed.temperature, cfg.embed.symmetric, tuple(cfg.embed.matryoshka_dims),
                            cfg.embed.mask_duplicates)
    loss = fake_loss_bytes(shapes, settings)
    documents = shapes.global_samples * (1 + shapes.negatives)
    local_texts = shapes.local_samples * shapes.texts_per_sample
    chunk = f"at most {cfg.embed.chunk_tokens} padded tokens" if cfg.embed.chunk_tokens else "no embed.chunk_tokens"
    return [Term("activations", forward.by_kind["activations"],
                 f"one forward with gradient of {shapes.texts_per_forward} texts × {shapes.seq_len} tokens ({chunk}; "
                 "GradCache re-embeds a forward at a time), fp32, dropout keyed per text"),
            Term("embeddings and gradient cache", kept_vector_bytes(shapes),
                 f"the {local_texts} local texts' fp32 vectors twice (embedded, split), their gradient cache, one "
                 "micro-batch's cache rows, text ids"),
            Term("contrastive loss", loss.total,
                 f"global batch, fp64, on every rank: {shapes.global_samples} queries × {documents} documents; "
                 "the gathered vectors, the loss's saved log-softmax and mask, the similarity's gradient, the vectors' "
                 "gradients (before the forwards with gradient, not beside them)")]


def estimate_embed_memory(cfg: EmbedRunConfig, world_size: int, dtype: str | None = None,
                          vocab_size: int | None = None, device: str | None = None) -> MemoryEstimate:
    """Every term of one rank's memory (rank 0) of `isotrain embed` with `cfg` on `world_size` processes."""
    from isotrain.embed.model import check_embed_layout, check_embedder
    from isotrain.models.loading import declared_config
    from isotrain.parallel.dims import check_model_fits, resolve_dims

    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} cannot be estimated; use cpu or cuda")
    if dtype not in (None, "float32"):
        raise ConfigError(f"--dtype {dtype} cannot be estimated for isotrain embed, which computes in float32 "
                          "(it applies no compute dtype); drop --dtype or pass --dtype float32")
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
    ignored = _not_applied(cfg)
    settings = {"world_size": world_size, **dict(degrees.as_rows()), "dtype": "float32", "device": device,
                "micro_batch_size": cfg.train.micro_batch_size, "max_seq_len": cfg.data.max_seq_len,
                "global_batch_size": cfg.train.global_batch_size, "hard_negatives": cfg.embed.hard_negatives or 0,
                "chunk_tokens": cfg.embed.chunk_tokens, "vocab_size": vocab_size, "vocab_size_source": how,
                "step": "embed", "parameters": sum(p.numel() for p in model.parameters())}
    not_counted = ["the no-gradient forwards' transient activations (one layer at a time)"]
    if degrees.dp_size > 1 and not degrees.fsdp:
        not_counted.append("the flat fp32 copy of the gradients that sums them over replicas at the end of the step")
    if cfg.embed.hard_negatives is None:
        not_counted.append("hard negatives (embed.hard_negatives unset: 0 assumed; the run takes the fewest a data "
                           "row carries)")
    if ignored:
        not_counted.append(f"{', '.join(ignored)}: not applied by isotrain embed, so not here either")
    settings["not_counted"] = "; ".join(not_counted)
    terms = [*model_state_terms(model, config, degrees, "float32"), *fsdp_terms(model, config, degrees, "float32"),
             *step_terms(cfg, config, degrees, device)]
    return MemoryEstimate(settings, terms)
