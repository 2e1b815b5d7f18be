"""The per-family expert key table against what `save_pretrained` of a freshly built model writes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from isotrain.models.expert_keys import FORMATS, expert_format, fused_name, key_problems, saved_parts
from isotrain.parallel.boxes import box_index
from isotrain.parallel.dims import num_experts

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def tiny(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SIZES, **FAMILIES[model_type])
    return AutoModelForCausalLM.from_config(config)


def split(model) -> dict[str, torch.Tensor]:
    """The model's tensors under their saved keys, cut from the in-memory tensors by the table."""
    fmt = expert_format(model.config)
    out = {}
    for name, tensor in model.state_dict().items():
        for part in saved_parts(name, tuple(tensor.shape), fmt):
            block = tensor[box_index(part.box)]
            out[part.key] = block[0] if part.drop_first else block
            assert tuple(out[part.key].shape) == part.shape
    return out


def test_every_family_in_the_table_is_tested():
    assert set(FORMATS) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_keys_shapes_and_values_are_those_save_pretrained_writes(tmp_path, model_type):
    model = tiny(model_type)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ours = split(model)
    assert ours.keys() == saved.keys()
    for key in saved:
        assert torch.equal(ours[key], saved[key]), key  # gate is the first half of gate_up_proj, up the second
    assert any(".experts.3." in key for key in saved)  # per expert: the table is exercised, not bypassed


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_per_expert_keys_map_back_to_the_fused_tensor_and_expert(model_type):
    model = tiny(model_type)
    fmt = expert_format(model.config)
    fused = {name: torch.zeros_like(t) for name, t in model.state_dict().items() if name.endswith("_proj")
             and t.ndim == 3}
    for key, tensor in split(model).items():
        back = fused_name(key, fmt)
        if back is None:
            continue
        name, expert = back
        part = next(p for p in saved_parts(name, tuple(fused[name].shape), fmt) if p.key == key)
        assert part.expert == expert
        fused[name][box_index(part.box)] = tensor
    assert fused and all(torch.equal(fused[name], model.state_dict()[name]) for name in fused)


def test_a_missing_duplicated_or_extra_expert_is_named():
    fmt = expert_format({"model_type": "mixtral"})
    assert num_experts({"model_type": "mixtral", "num_local_experts": 4}) == 4
    keys = Counter(fmt.key("model.layers.0", e, leaf) for e in range(4) for leaf in ("w1", "w2", "w3"))
    assert key_problems(keys, 4, fmt) == []
    missing = keys - Counter(["model.layers.0.block_sparse_moe.experts.2.w3.weight"])
    assert key_problems(missing, 4, fmt) == [
        "expert tensor 'model.layers.0.block_sparse_moe.experts.2.w3.weight' is missing (expert 2 of 4)"]
    twice = keys + Counter(["model.layers.0.block_sparse_moe.experts.1.w1.weight"])
    assert key_problems(twice, 4, fmt) == [
        "expert tensor 'model.layers.0.block_sparse_moe.experts.1.w1.weight' is stored 2 times (an expert is "
        "duplicated)"]
    assert "names expert 4" in key_problems(keys + Counter(["model.layers.0.block_sparse_moe.experts.4.w2.weight"]),
                                            4, fmt)[0]
    both = keys + Counter(["model.layers.0.mlp.experts.down_proj"])
    assert key_problems(both, 4, fmt) == ["model.layers.0.mlp.experts.down_proj is stored beside the per-expert "
                                          "tensors of the same experts (an expert is duplicated)"]
