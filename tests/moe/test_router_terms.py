"""The router terms against transformers, the `moe` section's checks, and the load metrics.

On one process with one micro-batch both scopes pool exactly the tokens transformers pools, so isotrain's aux
loss must equal the model's own `aux_loss` output (load_balancing_loss_func, padding excluded through the
attention mask), and the z-loss the mean of logsumexp² over the same tokens and layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from moe_worker import FAMILIES  # noqa: E402  (the tiny MoE families of the layout tests)

CPU = torch.device("cpu")


def tiny(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = dict(FAMILIES[family])  # a variant of a family names its model_type
    config = AutoConfig.for_model(extra.pop("model_type", family), vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_experts_per_tok=2, **extra)
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
    # Every MoE layer (both, or one beside a dense layer) routes each of the 27 input tokens to 2 experts; padding
    # is not counted.
    moe_layers = 2 - len(getattr(model.config, "mlp_only_layers", None) or [])
    assert len(hf.router_logits) == moe_layers
    assert [sum(row) for row in result.router.counts] == [2 * int(real.sum())] * moe_layers
    assert settings.aux_loss_coef == model.config.router_aux_loss_coef  # moe.aux_loss_coef=null: the model's own


def test_logged_loss_is_the_whole_objective():
    """loss = cross-entropy + aux_loss_coef · aux + z_loss_coef · z; the coefficient 0 turns a term off."""
    losses, values = {}, {}
    settings = {"off": MoeConfig(aux_loss_coef=0.0), "on": MoeConfig(aux_loss_coef=0.3, z_loss_coef=0.02)}
    for name, moe in settings.items():
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


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor -> Python value conversions (each one a host sync on an accelerator)."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_router_terms_add_no_host_sync(num_micro_batches):
    """The router terms, the pre-pass (2 micro-batches) and the routing check read no value on the host: the step
    keeps its one fetch. Compared with the same step without router terms; the pre-pass's forwards bring only the
    reads of a forward itself (transformers' packed-sequence detection reads one boolean per forward)."""
    from collections import Counter

    batch = padded_batch()
    parts = [{k: (v[i::num_micro_batches] if torch.is_tensor(v) else v) for k, v in batch.items()}
             for i in range(num_micro_batches)]
    reads = {}
    for name in ("without", "with", "forward"):
        model = tiny("qwen3_moe")
        settings = router_settings(MoeConfig(z_loss_coef=0.01), model.config) if name == "with" else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with _HostReads() as probe:
            if name == "forward":
                model(input_ids=parts[0]["input_ids"], position_ids=parts[0]["position_ids"], use_cache=False)
            else:
                train_step(model, optimizer, parts, 0.0, StepOptions(router=settings), CPU)
        reads[name] = Counter(probe.reads)
    prepass_forwards = num_micro_batches if num_micro_batches > 1 else 0
    expected = reads["without"] + Counter({key: n * prepass_forwards for key, n in reads["forward"].items()})
    assert reads["with"] == expected


def test_zero_coefficients_skip_the_prepass_but_log_the_global_values():
    """moe.aux_loss_coef=0 and z_loss_coef=0: no pre-pass forward, no router gradient, the same logged values."""
    batch = padded_batch()
    parts = [{k: (v[i::2] if torch.is_tensor(v) else v) for k, v in batch.items()} for i in range(2)]
    results, forwards = {}, {}
    for name, moe in {"off": MoeConfig(aux_loss_coef=0.0), "on": MoeConfig(aux_loss_coef=0.1)}.items():
        model = tiny("qwen3_moe")
        calls = []
        model.register_forward_hook(lambda *args: calls.append(1))
        options = StepOptions(router=router_settings(moe, model.config))
        results[name] = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), parts, 0.0, options, CPU)
        forwards[name] = len(calls)
    assert forwards == {"off": 2, "on": 4}  # the pre-pass runs one more forward per micro-batch
    assert results["off"].router.counts == results["on"].router.counts
    assert results["off"].router.aux_loss == pytest.approx(results["on"].router.aux_loss, rel=1e-12)
    assert results["off"].router.z_loss == pytest.approx(results["on"].router.z_loss, rel=1e-12)
