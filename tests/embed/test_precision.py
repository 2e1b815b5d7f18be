"""`isotrain embed` applies model.dtype and train.activation_checkpointing (it used to ignore both): bf16 computes
in bf16 over fp32 master weights and gradients, a loss close to fp32's; checkpointing recomputes each encoder layer
with the same keyed dropout masks, so the loss and gradients equal those without it. train.compile is refused."""

from __future__ import annotations

import math

import pytest
import torch

from embed.embed_cases import STEP, dataset, grads_of, micro_batches, relative_error
from isotrain.config import build_config
from isotrain.embed.gradcache import embed_forward_backward
from isotrain.embed.loss import LossSettings
from isotrain.embed.model import build_embedder, encode_options
from isotrain.models.tokenizer import train_tokenizer

# A BERT encoder with dropout on the hidden states and the attention probabilities (eager attention, keyed masks).
BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64, "vocab_size": 64, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1}


def embed_config(**train):
    dtype = train.pop("dtype", "float32")
    return build_config({"model": {"config": BERT, "dtype": dtype}, "data": {"max_seq_len": 16},
                         "embed": {"pooling": "mean", "chunk_tokens": 30},
                         "train": {"micro_batch_size": 2, "global_batch_size": 8, **train}}, "embed")


def step(cfg, ga: int = 2):
    """(model, loss, gradients) of one GradCache step of the recipe's model and encode options for `cfg`."""
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    model = build_embedder(cfg, tokenizer, torch.device("cpu"))
    options = encode_options(cfg, tokenizer, fsdp=False)
    mbs = micro_batches(dataset(2), 0, 1, ga)
    result = embed_forward_backward(model, mbs, LossSettings(temperature=0.1), options, STEP, torch.device("cpu"))
    return model, result.loss, grads_of(model)


def test_bf16_computes_in_bf16_over_fp32_master_weights():
    _, fp32_loss, fp32_grads = step(embed_config())
    model, loss, grads = step(embed_config(dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert loss != fp32_loss  # bf16 really computed: the loss moved ...
    assert loss == pytest.approx(fp32_loss, rel=2e-2)  # ... by bf16 rounding only
    assert relative_error(grads, fp32_grads) < 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_keeps_the_loss_and_gradients(dtype):
    """Deterministic, dropout on (hidden states and attention probabilities), 2 micro-batches of several padded
    forwards each: the recomputed layers draw the masks of their first forward (and, in bf16, recompute under the
    same autocast). Without the masks' replay the gradients are off by 100 % (measured)."""
    torch.use_deterministic_algorithms(True)
    try:
        _, want_loss, want = step(embed_config(dtype=dtype))
        model, loss, grads = step(embed_config(dtype=dtype, activation_checkpointing="full"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(layer.gradient_checkpointing for layer in model.encoder.layer)
    assert math.isclose(loss, want_loss, rel_tol=1e-6)
    assert relative_error(grads, want) <= 1e-6


def test_train_compile_is_refused_not_ignored(data, tmp_path):
    from zygote import run_isotrain

    from embed.test_embed_cli import BERT

    proc = run_isotrain(["embed", *BERT, f"data.path={data}", f"output_dir={tmp_path / 'run'}", "train.compile=true"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: train.compile=true is not supported by isotrain embed" in proc.stderr, proc.stderr[-2000:]
