"""One rule for "is this a mixture-of-experts model": parallelism, checkpoints and the router terms agree.

Before, a config with `num_experts` but no `num_experts_per_tok` was MoE for parallel/dims.py and
models/expert_keys.py and dense for moe/settings.py. The rule now lives in `parallel.dims.num_experts`; these
tests pin the disagreeing case and transformers' own spellings, and check every user answers the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from isotrain.config import MoeConfig
from isotrain.errors import ConfigError
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.parallel.dims import ParallelDims, check_model_fits, has_dense_mlp, is_moe, num_experts


def test_experts_without_top_k_is_moe_everywhere():
    # Switch Transformers' shape: experts, top-1 routing, no num_experts_per_tok field.
    config = SimpleNamespace(model_type="switch_like", num_experts=8)
    assert num_experts(config) == 8 and is_moe(config)
    assert num_experts({"model_type": "switch_like", "num_experts": 8}) == 8  # config.json as a dict
    assert not has_dense_mlp(config)  # parallel/ treats it as MoE
    check_model_fits(ParallelDims(dp_replicate=1, dp_shard=2, tp=1, ep=2), config)  # ep=2 splits its 8 experts: accepted
    # moe/: not dense, so moe.* settings are allowed; the router terms ask for the missing top-k by name.
    check_moe_section(MoeConfig(z_loss_coef=0.1), config)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        router_settings(MoeConfig(), config)


@pytest.mark.parametrize("fields, expected", [
    ({"num_experts": 60, "num_experts_per_tok": 4}, 60),  # Qwen2-MoE, OLMoE, Jamba
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, 8),  # Mixtral, PhiMoE, GraniteMoE, GPT-OSS
    ({"n_routed_experts": 256, "num_experts_per_tok": 8}, 256),  # DeepSeek V2/V3 config.json
    ({}, None),  # dense
    ({"num_experts": 0}, None),  # no routed experts
    ({"num_experts": None, "num_local_experts": None}, None),
])
def test_transformers_spellings(fields, expected):
    assert num_experts({"model_type": "m", **fields}) == expected
    assert num_experts(SimpleNamespace(model_type="m", **fields)) == expected


def test_transformers_moe_configs():
    transformers = pytest.importorskip("transformers")
    for name, experts in [("MixtralConfig", 8), ("Qwen3MoeConfig", 128), ("Qwen2MoeConfig", 60), ("OlmoeConfig", 64)]:
        assert num_experts(getattr(transformers, name)()) == experts, name
    assert num_experts(transformers.LlamaConfig()) is None


def test_dense_model_refuses_moe_settings():
    config = SimpleNamespace(model_type="llama")
    assert router_settings(MoeConfig(), config) is None
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        check_moe_section(MoeConfig(z_loss_coef=0.1), config)
