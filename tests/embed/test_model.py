"""Which layouts `isotrain embed` takes: data parallel, replicated or sharded by FSDP2; TP and EP refused in one
sentence naming the values and the fix."""

import pytest

from isotrain.embed.model import check_embed_layout
from isotrain.errors import ConfigError
from isotrain.parallel.dims import ParallelDims


@pytest.mark.parametrize("dims", [ParallelDims(2, 1, 1), ParallelDims(1, 2, 1), ParallelDims(2, 2, 1),
                                  ParallelDims(1, 1, 1, shard_one_rank=True)])
def test_data_parallel_layouts_are_accepted(dims):
    check_embed_layout(dims)


@pytest.mark.parametrize("dims", [ParallelDims(1, 1, 2), ParallelDims(2, 1, 1, ep=2)])
def test_tensor_and_expert_parallel_are_refused(dims):
    with pytest.raises(ConfigError) as err:
        check_embed_layout(dims)
    assert str(err.value) == (f"isotrain embed runs data parallel only, replicated or sharded by FSDP2 (got parallel.tp="
                              f"{dims.tp}, ep={dims.ep}); set parallel.tp=1 and parallel.ep=1 and use parallel.dp_shard "
                              "or parallel.dp_replicate")


def test_every_embedder_family_gets_one_fsdp2_unit_per_layer():
    """The layers FSDP2 wraps one by one (parallel/apply.py): a BERT encoder's `encoder.layer`, a base decoder's own
    `layers` (what AutoModel builds for `isotrain embed`), a causal LM's `model.layers` as before."""
    from transformers import AutoModel, AutoModelForCausalLM, BertConfig, LlamaConfig

    from isotrain.parallel.apply import decoder_layers

    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64)
    llama = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64)
    encoder, decoder, causal_lm = (AutoModel.from_config(bert), AutoModel.from_config(llama),
                                   AutoModelForCausalLM.from_config(llama))
    assert decoder_layers(encoder) == list(encoder.encoder.layer)
    assert decoder_layers(decoder) == list(decoder.layers)
    assert decoder_layers(causal_lm) == list(causal_lm.model.layers)
