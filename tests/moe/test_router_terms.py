"""The router terms against transformers, the `moe` section's checks, and the load metrics.

On one process with one micro-batch both scopes pool exactly the tokens transformers pools, so isotrain's aux
loss must equal the model's own `aux_loss` output (load_balancing_loss_func, padding excluded through the
attention mask), and the z-loss the mean of logsumexp² over the same tokens and layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isotrain.config import MoeConfig
from isotrain.data.collate import collate
from isotrain.data.packing import Sample
from isotrain.errors import ConfigError
from isotrain.moe.metrics import expert_shares, load_ratio, router_metrics
from isotrain.moe.objective import RouterValues
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.train.step import StepOptions, train_step

CPU = torch.device("cpu")
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "head_dim": 8},
    "mixtral": {"num_local_experts": 4, "sliding_window": None},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
}


def tiny(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                                  **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config)
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            torch.nn.init.normal_(param, std=1.0)
    return model


def padded_batch() -> dict:
    """4 rows of 3 to 11 tokens: the shorter rows are padded."""
    rng = np.random.default_rng(0)
    samples = []
    for n in (11, 5, 8, 3):
        ids = rng.integers(1, 64, n)
        samples.append(Sample(ids, ids, np.arange(n), np.zeros(n, dtype=np.int64), (0,)))
    return collate(samples, pad_id=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scope", ["global", "micro_batch"])
def test_one_micro_batch_gives_transformers_aux_loss(family, scope):
    model = tiny(family)
    batch = padded_batch()
    real = (batch["segment_ids"] >= 0).long()
    with torch.no_grad():
        hf = model(input_ids=batch["input_ids"], attention_mask=real, output_router_logits=True)
    settings = router_settings(MoeConfig(aux_loss_scope=scope, z_loss_coef=0.01), model.config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    result = train_step(model, optimizer, [batch], 0.0, StepOptions(router=settings), CPU)

    assert result.router.aux_loss == pytest.approx(float(hf.aux_loss), rel=1e-6)
    mask = real.reshape(-1).bool()
    lse = torch.stack([torch.logsumexp(layer.float(), -1)[mask] for layer in hf.router_logits])
    assert result.router.z_loss == pytest.approx(float(lse.square().mean()), rel=1e-6)
    # Every layer routes each of the 27 input tokens to 2 experts; padding is not counted.
    assert [sum(row) for row in result.router.counts] == [2 * int(real.sum())] * 2
    assert settings.aux_loss_coef == model.config.router_aux_loss_coef  # moe.aux_loss_coef=null: the model's own


def test_logged_loss_is_the_whole_objective():
    """loss = cross-entropy + aux_loss_coef · aux + z_loss_coef · z; the coefficient 0 turns a term off."""
    losses, values = {}, {}
    for name, moe in {"off": MoeConfig(aux_loss_coef=0.0), "on": MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02)}.items():
        model = tiny("qwen3_moe")
        options = StepOptions(router=router_settings(moe, model.config))
        result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [padded_batch()], 0.0, options, CPU)
        losses[name], values[name] = result.loss, result.router
    cross_entropy = losses["off"]  # both router coefficients 0
    assert losses["on"] == pytest.approx(cross_entropy + 0.3 * values["on"].aux_loss + 0.02 * values["on"].z_loss,
                                         rel=1e-9)
    assert values["on"].aux_loss == values["off"].aux_loss  # the same routing: the coefficient only weighs it


def test_moe_settings_are_refused_on_a_dense_model():
    from transformers import AutoConfig

    dense = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4)
    check_moe_section(MoeConfig(), dense)  # the defaults say nothing: accepted
    assert router_settings(MoeConfig(), dense) is None
    for override, text in [({"aux_loss_coef": 0.01}, "moe.aux_loss_coef=0.01"),
                           ({"aux_loss_scope": "micro_batch"}, "moe.aux_loss_scope='micro_batch'"),
                           ({"z_loss_coef": 0.001}, "moe.z_loss_coef=0.001")]:
        key = text.split("=")[0]
        with pytest.raises(ConfigError) as err:
            check_moe_section(MoeConfig(**override), dense)
        assert str(err.value) == (f"{text} is set but the model (llama) has no mixture-of-experts layers; remove "
                                  f"{key} or train an MoE model")


def test_load_metrics():
    counts = [[30, 10, 20, 20], [20, 20, 20, 20]]
    assert expert_shares(counts) == [[0.375, 0.125, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]
    assert load_ratio(counts) == 3.0
    assert load_ratio([[40, 0, 20, 20]]) is None  # an idle expert: no finite ratio
    row = router_metrics(RouterValues(aux_loss=1.25, z_loss=0.5, counts=counts))
    assert row == {"aux_loss": 1.25, "z_loss": 0.5, "load_ratio": 3.0, "expert_share": expert_shares(counts)}
