"""The router terms a run trains a mixture-of-experts model with (config section `moe`).

Whether a model is MoE is decided by `parallel.dims.num_experts` (one rule for the whole package); the router
terms also read the config's `num_experts_per_tok` (top-k) and `router_aux_loss_coef`.
"""

from __future__ import annotations

from dataclasses import dataclass

from isotrain.errors import ConfigError
from isotrain.parallel.dims import num_experts


@dataclass(frozen=True)
class RouterSettings:
    """The router terms of an MoE run. aux = E · Σ_e f_e · P_e (transformers' load_balancing_loss_func)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float
    aux_loss_scope: str  # "global" | "micro_batch"
    z_loss_coef: float


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
    top_k = getattr(model_config, "num_experts_per_tok", None)
    if not top_k:
        raise ConfigError(f"the model ({model_config.model_type}) has {experts} experts but its config has no "
                          "num_experts_per_tok (experts per token); isotrain's router terms need it: set it in the "
                          "model config")
    coef = moe_cfg.aux_loss_coef
    if coef is None:
        coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
    return RouterSettings(num_experts=experts, top_k=int(top_k), aux_loss_coef=coef,
                          aux_loss_scope=moe_cfg.aux_loss_scope, z_loss_coef=moe_cfg.z_loss_coef)
