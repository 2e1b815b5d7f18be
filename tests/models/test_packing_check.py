"""Packing keeps documents apart in every supported family, through isotrain's own path.

Each tiny model is built by isotrain's builder from a config (no downloads); the run's packing probe decides
whether position ids suffice or isotrain passes its per-document mask; then the step's forward and loss give
packed rows the per-document logits, loss and gradients of the same documents run alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isotrain.config import ModelConfig
from isotrain.data.collate import collate
from isotrain.data.packing import sample_from_documents
from isotrain.data.tokenize import Example
from isotrain.errors import ConfigError
from isotrain.models.build import build_plain
from isotrain.models.packing_check import check_packing, lm_logits
from isotrain.models.tokenizer import train_tokenizer
from isotrain.train.step import StepOptions, forward_backward

CPU = torch.device("cpu")
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
# family: (config, attention kernel, whether isotrain must pass its own mask). Dropout off: packed and
# unpacked runs must see the same network.
FAMILIES = {
    "llama": ({"model_type": "llama", **SMALL}, "sdpa", False),
    "qwen2": ({"model_type": "qwen2", **SMALL}, "sdpa", False),
    "qwen3": ({"model_type": "qwen3", "head_dim": 16, **SMALL}, "sdpa", False),
    "mistral": ({"model_type": "mistral", **SMALL}, "sdpa", False),
    "gpt2": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0}, "sdpa", False),
    "gemma": ({"model_type": "gemma", "head_dim": 16, **SMALL}, "sdpa", False),
    # transformers 5.23 has no sdpa path for Gemma 2.
    "gemma2": ({"model_type": "gemma2", "head_dim": 16, **SMALL}, "eager", False),
    "phi3": ({"model_type": "phi3", **SMALL}, "sdpa", False),
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **SMALL}, "sdpa", False),
    "qwen3_moe": ({"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, **SMALL}, "sdpa", False),
    # OPT builds its causal mask without position ids: only isotrain's mask keeps its documents apart.
    "opt": ({"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "word_embed_proj_dim": 64, "max_position_embeddings": 64, "dropout": 0.0, "attention_dropout": 0.0},
            "sdpa", True),
    "opt-eager": ({"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "word_embed_proj_dim": 64, "max_position_embeddings": 64,
                   "dropout": 0.0, "attention_dropout": 0.0}, "eager", True),
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["0123456789 abcdefghijklmnopqrstuvwxyz+="] * 4, "char", 64)


def tiny(tokenizer, config: dict, attn: str):
    return build_plain(ModelConfig(config=config, attn_implementation=attn), tokenizer, seed=3)


def documents(vocab_size: int) -> list[Example]:
    """Five documents of 3..9 tokens; the first token of each is not trained, as after a prompt."""
    rng = np.random.default_rng(0)
    docs = []
    for row, length in enumerate([7, 3, 9, 5, 4]):
        ids = rng.integers(4, vocab_size, size=length)
        labels = np.concatenate([ids[1:], [-100]])
        labels[0] = -100
        docs.append(Example(ids.astype(np.int64), labels.astype(np.int64), row))
    return docs


def per_document_logits(model, batch: dict, with_mask: bool) -> list[torch.Tensor]:
    """Logits of every document of a collated batch, in row and segment order."""
    with torch.no_grad():
        logits = lm_logits(model, batch["input_ids"], batch["position_ids"], with_mask)
    return [logits[row][batch["segment_ids"][row] == seg]
            for row in range(logits.shape[0]) for seg in range(int(batch["segment_ids"][row].max()) + 1)]


def loss_and_grads(model, micro_batches: list[dict], with_mask: bool):
    model.zero_grad(set_to_none=True)
    options = StepOptions(loss_reduction="sequence", document_mask=with_mask)  # per-document means
    loss, _ = forward_backward(model, micro_batches, options, CPU)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_match_unpacked(tokenizer, family):
    config, attn, expect_mask = FAMILIES[family]
    model = tiny(tokenizer, config, attn)
    with_mask = check_packing(model, CPU)
    assert with_mask == expect_mask
    docs = documents(len(tokenizer))
    # Two packed rows of different lengths (the shorter is padded, its positions continue the last document).
    packed = [collate([sample_from_documents(docs[:3]), sample_from_documents(docs[3:])], tokenizer.pad_token_id)]
    alone = [collate([sample_from_documents([doc])], tokenizer.pad_token_id) for doc in docs]

    packed_logits = per_document_logits(model, packed[0], with_mask)
    alone_logits = [per_document_logits(model, batch, with_mask)[0] for batch in alone]
    for doc, got, want in zip(docs, packed_logits, alone_logits):
        assert got.shape[0] == len(doc.input_ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    packed_loss, packed_grads = loss_and_grads(model, packed, with_mask)
    alone_loss, alone_grads = loss_and_grads(model, alone, with_mask)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-6)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_isotrain_mask_opt_packs_documents_into_each_other(tokenizer):
    """What the probe guards against: OPT with positions only gives packed documents other logits."""
    config, attn, _ = FAMILIES["opt"]
    model = tiny(tokenizer, config, attn)
    docs = documents(len(tokenizer))
    packed = collate([sample_from_documents(docs[:2])], tokenizer.pad_token_id)
    alone = collate([sample_from_documents([docs[1]])], tokenizer.pad_token_id)
    leaked = per_document_logits(model, packed, with_mask=False)[1]
    assert (leaked - per_document_logits(model, alone, with_mask=False)[0]).abs().max() > 1e-2


def test_a_family_that_takes_neither_positions_nor_a_mask_is_refused(tokenizer):
    """BLOOM derives its ALiBi positions from a 2-D attention mask and cannot take a 4-D one."""
    config = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4}
    model = tiny(tokenizer, config, "eager")
    with pytest.raises(ConfigError) as caught:
        check_packing(model, CPU)
    assert str(caught.value) == (
        "data.packing=true would let packed documents attend to each other in BloomForCausalLM, which ignores "
        "the position-id restarts that mark them and cannot take isotrain's per-document attention mask; set "
        "data.packing=false")
    assert model.training  # the probe's eval mode was undone


def test_the_probe_draws_no_random_numbers_and_keeps_the_training_mode(tokenizer):
    config, attn, _ = FAMILIES["opt"]
    model = tiny(tokenizer, {**config, "dropout": 0.1}, attn)
    torch.manual_seed(5)
    assert check_packing(model, CPU) is True
    assert model.training
    after_probe = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_probe, torch.rand(3))


def test_a_family_with_a_sliding_window_is_refused_rather_than_masked(tokenizer):
    """isotrain's mask has no window: a family that ignores restarts and slides a window would lose it."""
    config, attn, _ = FAMILIES["opt"]
    model = tiny(tokenizer, {**config, "sliding_window": 4}, attn)
    with pytest.raises(ConfigError, match="OPTForCausalLM, which ignores the position-id restarts"):
        check_packing(model, CPU)
