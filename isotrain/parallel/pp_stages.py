"""Which modules of a Hugging Face causal LM a pipeline stage holds (parallel.pp; the pipeline itself: parallel/pp.py).

The layer split (`stage_layers`), the parameter-free stand-ins of what another stage holds (`PassThrough` for a
decoder layer, `HandOff` for an earlier stage's head), the view each stage of a rank of several stages runs
(`stage_view`), and `whole_model`, which lends the other stages' modules back for code that walks the whole model
(LoRA's adapters). They sit apart from parallel/pp.py, which cuts the model with them (`apply_pp`) and runs its
stages, so that each file keeps one job of a readable size.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
from torch import nn


class PassThrough(nn.Module):
    """A decoder layer that another stage holds: hidden states go through unchanged, with no parameters."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class HandOff(nn.Module):
    """An earlier stage's LM head, with no parameters: the hidden states go on to the next stage as a tensor of their
    own. transformers hands the head a slice of them, and a view returned by the model's forward would lose FSDP2's
    backward hook to any in-place op (FSDP2 warns of it)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.clone()


def stage_layers(num_layers: int, pp: int, stage: int, split: Sequence[int] | None = None) -> range:
    """The decoder layers of `stage` of `pp` stages: `split[s]` layers for stage s, in order (parallel.pp_split,
    checked to have `pp` positive entries summing to L), or without a split L // pp each, the first L mod pp stages
    one more (checked: L >= pp)."""
    if split is not None:
        start = sum(split[:stage])
        return range(start, start + split[stage])
    size, extra = divmod(num_layers, pp)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def base_model(model: nn.Module) -> nn.Module:
    """The decoder under the causal LM's head (`model.model` for Llama), which holds the layers, the input embedding
    and the final norm."""
    return getattr(model, getattr(model, "base_model_prefix", "model"))


def ties_embeddings(model: nn.Module) -> bool:
    """Whether the model's input embedding and LM head are one weight (its config's `tie_word_embeddings`)."""
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


@contextlib.contextmanager
def whole_model(model: nn.Module, skeleton: nn.Module):
    """While open, every module that this rank's stages do not hold (a layer, the input embedding, the final norm,
    the head) is `skeleton`'s, the whole model on the meta device: code that walks the whole model's modules in
    order and draws from the RNG for each (peft adding LoRA adapters) draws here what one process draws, and this
    rank's own modules get one process's values. What that code puts into the skeleton's modules goes with them."""
    base, whole = base_model(model), base_model(skeleton)
    stand_ins = [(base.layers, str(index), whole.layers[index]) for index, layer in enumerate(base.layers)
                 if isinstance(layer, PassThrough)]
    if base.embed_tokens is None:
        stand_ins.append((base, "embed_tokens", whole.embed_tokens))
    if isinstance(base.norm, nn.Identity):
        stand_ins.append((base, "norm", whole.norm))
    if isinstance(model.lm_head, HandOff):
        stand_ins.append((model, "lm_head", skeleton.lm_head))
    held = [(parent, name, parent._modules[name]) for parent, name, _ in stand_ins]
    for parent, name, module in stand_ins:
        parent._modules[name] = module
    try:
        yield model
    finally:
        for parent, name, module in held:
            parent._modules[name] = module


def stage_view(model: nn.Module, stage: int, num_stages: int, split: Sequence[int] | None = None) -> nn.Module:
    """The model as stage `stage` runs it when its rank holds several stages (interleaved schedules): a shallow copy
    whose module tables are its own, sharing every parameter and layer with `model`, in which the rank's other
    stages' layers pass through, a stage after the first has no input embedding and a stage before the last hands
    its hidden states on (no final norm, no head): each parameter belongs to the view of one stage."""
    base = base_model(model)
    view, view_base = copy.copy(model), copy.copy(base)
    view._modules, view_base._modules = dict(model._modules), dict(base._modules)
    view._modules[getattr(model, "base_model_prefix", "model")] = view_base
    own = stage_layers(len(base.layers), num_stages, stage, split)
    view_base._modules["layers"] = nn.ModuleList(
        [layer if index in own else PassThrough() for index, layer in enumerate(base.layers)])
    # A later stage is given hidden states; the last keeps a tied embedding's module, whose weight is its head's, so
    # that an FSDP2 root over the view (parallel/apply.py shard_stages) holds both of the weight's slots.
    if stage > 0 and not (stage == num_stages - 1 and ties_embeddings(model)):
        view_base._modules["embed_tokens"] = None
    if stage < num_stages - 1:
        view_base._modules["norm"] = nn.Identity()
        view._modules["lm_head"] = HandOff()
    return view
