"""Dropout keyed per sample (isotrain/embed/dropout.py): one text's masks, at every dropout site including the
attention probabilities, are the same alone, in a padded batch (left or right padding), beside other neighbours
and in the no-gradient and the gradient pass; the model is left as it was; unkeyable sites are refused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import isotrain.embed.dropout as keyed
from embed.embed_cases import tiny_encoder
from isotrain.embed.encode import EncodeOptions, encode_chunk
from isotrain.errors import ConfigError

TEXT, SEED = [5, 9, 14, 3, 27, 8], 1234
SHORT, LONG, OTHER = [7, 2], [11, 4, 6, 8, 10, 12, 14, 16, 18, 20], [30, 31, 32, 33, 34, 35, 36]


def run(model, texts, seeds, side="right", grad=False):
    """(vectors, [(site, call, mask)] of the row whose seed is SEED) of one train-mode forward."""
    recorded = []
    original = keyed.row_keep

    def recording(generator, text_seed, site, call, shape, p):
        mask = original(generator, text_seed, site, call, shape, p)
        if text_seed == SEED:
            recorded.append((site, call, mask))
        return mask

    keyed.row_keep = recording
    try:
        options = EncodeOptions(pooling="mean", padding_side=side)
        with torch.set_grad_enabled(grad):
            vectors = encode_chunk(model, texts, seeds, options, torch.device("cpu"))
    finally:
        keyed.row_keep = original
    return vectors, recorded


def test_masks_of_a_text_do_not_depend_on_its_batch():
    model = tiny_encoder().double().train()
    alone, want = run(model, [TEXT], [SEED])
    # 2 layers: embeddings, then per layer attention probabilities, attention output, feed-forward output.
    assert len(want) == 1 + 2 * 3
    attention = [mask for _, _, mask in want if mask.dim() == 3]
    assert [tuple(mask.shape) for mask in attention] == [(2, len(TEXT), len(TEXT))] * 2
    assert all(0 < mask.sum() < mask.numel() for _, _, mask in want)  # dropout drops, and keeps
    contexts = {"right": ([SHORT, TEXT, LONG], [1, SEED, 2], "right", False),
                "left": ([SHORT, TEXT, LONG], [1, SEED, 2], "left", False),
                "other neighbours": ([OTHER, LONG, LONG, TEXT], [3, 4, 5, SEED], "right", False),
                "gradient pass": ([SHORT, TEXT, LONG], [1, SEED, 2], "right", True)}
    for name, (texts, seeds, side, grad) in contexts.items():
        vectors, got = run(model, texts, seeds, side, grad)
        assert [(site, call) for site, call, _ in got] == [(site, call) for site, call, _ in want], name
        assert all(torch.equal(g, w) for (_, _, g), (_, _, w) in zip(got, want)), name
        # Same masks, padding masked out: the same vector up to fp64 rounding of a different batch shape.
        torch.testing.assert_close(vectors[seeds.index(SEED)], alone[0], rtol=1e-12, atol=1e-12, msg=name)
    another_seed, _ = run(model, [TEXT], [SEED + 1])
    assert (another_seed - alone).abs().max() > 1e-3  # the masks follow the seed


def test_the_model_is_left_as_it_was():
    model = tiny_encoder().double().train()
    kernel = model.config._attn_implementation
    functional = (F.dropout, F.scaled_dot_product_attention)
    run(model, [TEXT, LONG], [SEED, 1], grad=True)
    assert model.config._attn_implementation == kernel
    assert (F.dropout, F.scaled_dot_product_attention) == functional
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Dropout))
    assert model.training


def test_decoder_attention_dropout_is_keyed_with_left_and_right_padding():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.2)
    model = LlamaModel(config).double().train()
    alone, want = run(model, [TEXT], [SEED])
    assert len(want) == 2 and all(mask.shape == (4, len(TEXT), len(TEXT)) for _, _, mask in want)
    for side in ("left", "right"):
        vectors, got = run(model, [LONG, TEXT, SHORT], [1, SEED, 2], side)
        assert all(torch.equal(g, w) for (_, _, g), (_, _, w) in zip(got, want)) and len(got) == len(want)
        torch.testing.assert_close(vectors[1], alone[0], rtol=1e-12, atol=1e-12)


class Toy(nn.Module):
    """An embedder whose dropout site sees [B, H, T]: its sequence axis is not dim 1."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed, self.layer = nn.Embedding(64, 8), layer

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.layer(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        return (hidden,)


def test_unkeyable_dropout_is_refused_naming_the_module():
    model = Toy(nn.Dropout(0.1)).train()
    with pytest.raises(ConfigError, match=r"dropout module 'layer' drops out a tensor of shape \[2, 8, 10\]"):
        run(model, [TEXT, LONG], [SEED, 1])
    with pytest.raises(ConfigError, match="Dropout2d module 'layer' cannot draw its masks per sample"):
        run(Toy(nn.Dropout2d(0.1)).train(), [TEXT], [SEED])
    assert F.dropout is torch.nn.functional.dropout and "forward" not in model.layer.__dict__


class FusedAttention(Toy):
    """An embedder whose attention drops out inside torch's fused kernel."""

    def forward(self, input_ids, attention_mask, position_ids):
        q = self.embed(input_ids).unsqueeze(1)
        return (F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).squeeze(1),)


def test_fused_attention_dropout_is_refused():
    with pytest.raises(ConfigError, match="inside torch's scaled_dot_product_attention"):
        run(FusedAttention(nn.Identity()).train(), [TEXT], [SEED])
    assert F.scaled_dot_product_attention is torch.nn.functional.scaled_dot_product_attention
