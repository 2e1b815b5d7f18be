"""Tensor parallelism with torch-native DTensor styles, mapped from the model's own plan.

Each decoder layer follows the model family's `base_model_tp_plan` (transformers ships one for Llama,
Qwen2/3, Mistral and most decoder families): attention heads and the MLP width are split column-wise on
the way in and row-wise on the way out, so one all-reduce per block joins them. Around that plan:

- the input embedding is vocabulary-parallel (rows split over TP ranks; the lookup is all-reduced);
- the LM head is column-parallel over the vocabulary. For SFT its logits stay sharded, `Shard(-1)`, and
  the cross-entropy runs under `loss_parallel`, so no rank ever holds a row of full-vocabulary logits;
  RL (which needs per-token log-probs and entropies) gathers them;
- every other parameter (norms, biases of replicated layers, heads outside the plan) becomes a
  `Replicate` DTensor, so every parameter of the model lives on the same mesh (clipping, the optimizer
  and FSDP2 over TP need that). Its forward runs on the local copy; the gradient either is complete on
  every rank (the input is replicated: norms) or is a per-rank part to be summed
  (`replicated_with_grad_allreduce`, e.g. Qwen3's q/k norms that see only this rank's heads);
- mixture-of-experts blocks: attention and dense MLP layers follow the plan, but the router and the routed
  experts (and Qwen2-MoE's shared expert and its gate) are replicated, not split: every TP rank holds every
  expert and runs it on the same tokens. Experts are split by expert parallelism (parallel/ep.py), which
  composes with TP: there they are DTensors `(Shard(0), Replicate())` on the ("ep", "tp") mesh.

A replicated parameter whose gradient reduction were missing would drift apart between TP ranks; the
trainer checks after the first update that they are identical (`check_replicated`).
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from isotrain.errors import ConfigError, IsotrainError
from isotrain.parallel.dims import has_dense_mlp, num_experts


class ReplicateParallel(ParallelStyle):
    """Parameters as `Replicate` DTensors; the module computes on local views of them.

    `grad_reduce=False`: every TP rank sees the same input, so each local gradient is already the full
    gradient. `grad_reduce=True`: each rank sees a different part (its heads), so the local gradients
    are partial sums, declared `Partial` and summed over TP before the update.
    """

    def __init__(self, grad_reduce: bool = False):
        super().__init__()
        self.grad_placements = (Partial(),) if grad_reduce else (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = []
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            replicated = DTensor.from_local(param.data, device_mesh, (Replicate(),), run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
            names.append(name)
        if not names:
            return module
        grad_placements = self.grad_placements
        swapped: dict[str, nn.Parameter] = {}

        def to_local(mod, args):
            for name in names:
                param = mod._parameters[name]
                swapped[name] = param
                # A plain tensor in _parameters for the duration of forward only, restored below.
                mod._parameters[name] = param.to_local(grad_placements=grad_placements)

        def restore(mod, args, output):
            for name in names:
                mod._parameters[name] = swapped.pop(name)
            return output

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module


STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce")


def _style(name: str, where: str) -> ParallelStyle:
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": lambda: ReplicateParallel(grad_reduce=True),
    }
    if name not in styles:
        raise ConfigError(
            f"the tensor-parallel plan of this model uses style {name!r} for {where}, which isotrain does not "
            f"support (supported: {', '.join(styles)}); use parallel.tp=1 for this model"
        )
    return styles[name]()


def _is_expert_entry(key: str) -> bool:
    """A plan entry for a MoE block's routed experts (`layers.*.mlp.experts`, `...experts.gate_up_proj`)."""
    return "experts" in key.split(".")


def layer_plan(config) -> dict[str, str]:
    """The model family's plan for its decoder layers, keys relative to the base model (`layers.*.mlp.up_proj`).

    Mixture-of-experts families: the entries for the routed experts are dropped. Tensor parallelism does
    not split experts (expert parallelism does); they and the router are replicated over TP like every
    module outside the plan. Every TP rank sees the same hidden states at the MoE block (o_proj's row-wise
    output is all-reduced), so each rank's expert and router gradients are already complete: no TP sum."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"model type {config.model_type!r} has no tensor-parallel plan (its transformers config ships none); "
            "use parallel.tp=1 for this model"
        )
    # The input embedding is apply_tp's own (vocabulary-parallel: transformers' `embedding_rowwise` split), which
    # some transformers releases (5.17) add to the plan of models with tied embeddings.
    plan = {key: name for key, name in plan.items() if name != "embedding_rowwise"}
    if num_experts(config) is not None:
        plan = {key: name for key, name in plan.items() if not _is_expert_entry(key)}
        if not has_dense_mlp(config):  # every layer sparse: the family's dense-MLP entries have nothing to split
            plan = {key: name for key, name in plan.items() if ".mlp." not in key}
    for where, name in plan.items():
        if name not in STYLES:
            raise ConfigError(
                f"the tensor-parallel plan of model type {config.model_type!r} uses style {name!r} for {where}, which "
                f"isotrain does not support (supported: {', '.join(STYLES)}); use parallel.tp=1 for this model"
            )
    return dict(plan)


def _expand(model: nn.Module, base_prefix: str, plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """Plan keys with `*` matched against the model's module names (a `*` is one name component)."""
    names = [name for name, _ in model.named_modules()]
    expanded: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(base_prefix + pattern).replace(r"\*", r"[^.]+") + "$")
        matched = [name for name in names if regex.match(name)]
        if not matched:
            raise ConfigError(
                f"the tensor-parallel plan entry {pattern!r} matches no module of this {model.config.model_type} "
                "model; use parallel.tp=1 for this model"
            )
        for name in matched:
            expanded[name] = _style(style, name)
    return expanded


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> nn.Module:
    """Shard `model` (a Hugging Face causal LM, or a base model with a head) over `tp_mesh` in place."""
    prefix = getattr(model, "base_model_prefix", "model")
    base_prefix = f"{prefix}." if hasattr(model, prefix) else ""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # Under pipeline parallelism the first stage's head is a parameterless hand-off: its copy of a tied weight is
    # the embedding alone (parallel/pp.py).
    tied = (bool(getattr(model.config, "tie_word_embeddings", False)) and head is not None
            and next(head.parameters(), None) is not None and model.get_input_embeddings() is not None)
    module_names = {module: name for name, module in model.named_modules()}
    plan = _expand(model, base_prefix, layer_plan(model.config))
    embedding = model.get_input_embeddings()
    if embedding is not None:  # (a later pipeline stage has none, and an earlier stage no head: parallel/pp.py)
        plan[module_names[embedding]] = RowwiseParallel(input_layouts=Replicate())  # vocabulary-parallel lookup
    if head is not None and next(head.parameters(), None) is not None:
        plan[module_names[head]] = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
                                    if loss_parallel else ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(model, tp_mesh, plan)
    if tied:
        # Both styles shard the [vocab, hidden] weight by rows, so the tied pair stays one parameter.
        head.weight = embedding.weight
    planned = set(plan)
    for name, module in model.named_modules():
        if name not in planned and any(True for _ in module.parameters(recurse=False)):
            ReplicateParallel()._apply(module, tp_mesh)
    return model


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as a plain tensor with the whole vocabulary (gathered from TP ranks if sharded)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _tp_axis(param: DTensor) -> int | None:
    names = param.device_mesh.mesh_dim_names or ()
    return names.index("tp") if "tp" in names else None


def check_replicated(model: nn.Module, tp_group) -> None:
    """Raise if a parameter replicated over TP differs between TP ranks (a gradient reduction is missing).

    Cheap: a digest of each replicated parameter's local bytes, one all_gather_object over the TP group.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    digests = {}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        axis = _tp_axis(param)
        if axis is None or not isinstance(param.placements[axis], Replicate):
            continue
        local = param.to_local().detach().to("cpu").contiguous()
        digests[name] = hashlib.blake2b(local.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    gathered: list = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(gathered, digests, group=tp_group)
    for name in digests:
        if len({ranks[name] for ranks in gathered}) > 1:
            raise IsotrainError(
                f"parameter {name} is replicated over tensor-parallel ranks but differs between them after the "
                "first update: a gradient reduction is missing for it; this is a bug in isotrain's tensor-parallel "
                "plan for this model, please report it"
            )
