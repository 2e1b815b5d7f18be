"""The tiny model and tokenizer the rollout-engine tests generate with."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

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
