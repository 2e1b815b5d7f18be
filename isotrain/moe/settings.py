"""Which models are mixture-of-experts models, and the router terms a run trains them with (config section `moe`).

transformers' MoE families name their sizes differently: Qwen2/3-MoE `num_experts`, Mixtral `num_local_experts`;
all of them `num_experts_per_tok` (top-k) and `router_aux_loss_coef`.
"""

from __future__ import annotations

from dataclasses import dataclass

from isotrain.errors import ConfigError

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class RouterSettings:
    """The router terms of an MoE run. aux = E · Σ_e f_e · P_e (transformers' load_balancing_loss_func)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float
    aux_loss_scope: str  # "global" | "micro_batch"
    z_loss_coef: float


def num_experts(model_config) -> int | None:
    """The number of routed experts of an MoE config; None for a dense model."""
    for key in _EXPERT_COUNT_KEYS:
        value = getattr(model_config, key, None)
        if value and getattr(model_config, "num_experts_per_tok", None):
            return int(value)
    return None


def check_moe_section(moe_cfg, model_config) -> None:
    """A dense model refuses any non-default `moe.*` setting: it would silently do nothing."""
    if num_experts(model_config) is not None:
        return
    for key, value in moe_cfg.model_dump().items():
        if value != type(moe_cfg).model_fields[key].default:
            raise ConfigError(f"moe.{key}={value!r} is set but the model ({model_config.model_type}) has no "
                              f"mixture-of-experts layers; remove moe.{key} or train an MoE model")


def router_settings(moe_cfg, model_config) -> RouterSettings | None:
    """The router terms for this model (None for a dense model): `moe.aux_loss_coef` null takes the model
    config's own `router_aux_loss_coef`."""
    check_moe_section(moe_cfg, model_config)
    experts = num_experts(model_config)
    if experts is None:
        return None
    coef = moe_cfg.aux_loss_coef
    if coef is None:
        coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
    return RouterSettings(num_experts=experts, top_k=int(model_config.num_experts_per_tok), aux_loss_coef=coef,
                          aux_loss_scope=moe_cfg.aux_loss_scope, z_loss_coef=moe_cfg.z_loss_coef)
