"""The Hugging Face model inside what training wraps it in: DDP, and peft's LoRA wrappers.

FSDP2 (`fully_shard`) and in-place `torch.compile` change a module's class, not its nesting, so
they need no unwrapping; only DDP (`.module`) and peft (`PeftModel` -> `LoraModel` -> the model)
nest the model inside another module.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP; any other model as it is (a peft model stays a peft model)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_lora(model: nn.Module) -> bool:
    return hasattr(unwrap(model), "peft_config")


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside DDP and/or a peft wrapper (LoRA layers, if any, still injected)."""
    from transformers import PreTrainedModel

    model = unwrap(model)
    # (peft also gives the Hugging Face model it adapts a `peft_config`: that model is returned as it is)
    if not is_lora(model) or isinstance(model, PreTrainedModel):
        return model
    if hasattr(model, "get_base_model"):
        return model.get_base_model()  # PeftModel -> the HF model with LoRA layers injected
    return model.model  # a bare LoraModel


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their Hugging Face names (tied weights once)."""
    base = unwrap(model)
    persistent = set(base.state_dict().keys())
    tensors = dict(base.named_parameters())
    tensors.update((name, buf) for name, buf in base.named_buffers() if name in persistent)
    return tensors
