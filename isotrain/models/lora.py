"""LoRA via peft: adapters on the trainer's model, the frozen base as the KL reference, merged sync.

With LoRA the reference policy of the KL term needs no second model: disabling the adapters
turns the trained model back into the frozen base, W x instead of (W + scale * B A) x.
peft is an optional dependency, imported inside each function that needs it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from isotrain.errors import ConfigError
from isotrain.models.unwrap import unwrap
from isotrain.models.weights import sync_named_tensors
from isotrain.parallel.pp_stages import whole_model


def _import_peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA (lora.r) needs the peft package; install it with: pip install peft") from None
    return peft


def linear_module_names(model: nn.Module) -> list[str]:
    """Last name component of every nn.Linear in `model` (q_proj, k_proj, ..., lm_head), sorted."""
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def apply_lora(model: nn.Module, r: int, alpha: int, target_modules: list[str], dropout: float = 0.0,
               skeleton: nn.Module | None = None):
    """A peft `PeftModel` with LoRA adapters (rank r, scale alpha / r) on the named linear layers.

    Only the adapters train; the base weights are frozen. A target name must equal a linear
    module's full name or its last component(s) (peft's rule), e.g. "q_proj".
    `skeleton`: under pipeline parallelism, the whole model on the meta device (`whole_meta_model`). peft draws each
    adapter's initial values from the RNG module after module, so the adapters are added with the modules of the
    other stages stood in by the skeleton's (parallel/pp_stages.py `whole_model`): every stage's adapters start as one
    process's, and the targets are checked against the whole model.
    """
    peft = _import_peft()
    whole = model if skeleton is None else skeleton
    if r < 1:
        raise ConfigError(f"lora.r={r} must be a positive rank, e.g. 8")
    if not target_modules:
        raise ConfigError(f"lora.target_modules is empty; choose from {linear_module_names(whole)}")
    linear_names = [name for name, module in whole.named_modules() if isinstance(module, nn.Linear)]
    for target in target_modules:
        if not any(name == target or name.endswith("." + target) for name in linear_names):
            raise ConfigError(
                f"lora.target_modules entry {target!r} matches no linear layer of the model; "
                f"available linear module names: {', '.join(linear_module_names(whole))}"
            )
    from isotrain.config import LoraConfig

    config = lora_config(LoraConfig(r=r, alpha=alpha, target_modules=list(target_modules), dropout=dropout))
    stage = contextlib.nullcontext() if skeleton is None else whole_model(model, skeleton)
    with warnings.catch_warnings(), stage:
        # peft reads transformers' deprecated is_gradient_checkpointing; a warning the user cannot act on.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, config)


def whole_meta_model(model: nn.Module) -> nn.Module:
    """The whole Hugging Face model of `model` (a pipeline stage) on the meta device: its modules, no memory."""
    with torch.device("meta"):
        return type(model)._from_config(copy.deepcopy(model.config))


def lora_config(lora):
    """peft's LoraConfig of the `lora` config section (what apply_lora trains with)."""
    peft = _import_peft()
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                           lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")


def _peft_model(model: nn.Module):
    model = unwrap(model)
    if not hasattr(model, "disable_adapter"):
        raise TypeError(f"{type(model).__name__} has no LoRA adapters; build it with apply_lora")
    return model


@contextlib.contextmanager
def reference_logits_context(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes the frozen reference policy (adapters disabled).

    No second copy of the model exists: the same parameters serve policy and reference.
    """
    peft_model = _peft_model(model)
    with peft_model.disable_adapter():
        yield model


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain causal LM's weights with W + scale * B @ A merged, by Hugging Face name (fp32, CPU)."""
    return dict(sync_named_tensors(model))


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names `save_adapter` writes them (peft's), single-process models only."""
    peft = _import_peft()
    return peft.get_peft_model_state_dict(_peft_model(model))


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """The adapter alone (adapter_config.json + adapter_model.safetensors), loadable by peft.

    Single-process models only: under FSDP2 gather or merge the weights first.
    """
    _import_peft()
    directory = Path(directory)
    _peft_model(model).save_pretrained(str(directory))
    return directory
