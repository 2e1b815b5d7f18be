"""The tiny model and tokenizer the rollout-engine tests generate with."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from isotrain.models.tokenizer import train_tokenizer


def digits_tokenizer():
    return train_tokenizer(["0123456789+= "], "char", 0)


def tiny_model(tokenizer, seed: int = 0, tie: bool = False):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked logits: greedy argmaxes are not near-ties
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_moe(tokenizer, seed: int = 0, kv_heads: int = 1, vocab_size: int | None = None):
    """A tiny Qwen3-MoE policy (4 experts, top-2, every layer sparse, fp32) that vLLM's CPU engine serves: heads of
    head_dim 32 (its attention kernel's least) and an expert width of 32 (its MoE kernel's multiple). `kv_heads` 2
    and an even `vocab_size` (above the tokenizer's) let tensor parallelism 2 split it."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=vocab_size or len(tokenizer), hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked logits: greedy argmaxes are not near-ties
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
