"""How many elements of each parameter one rank holds, by shard math on the full (meta) model.

Tensor parallelism follows parallel/tp.py: the family's `base_model_tp_plan` for decoder layers
(colwise: weight and bias split on dim 0; rowwise: weight split on dim 1, bias replicated), the input
embedding split on its vocabulary rows (dim 0), the LM head column-parallel (dim 0 of [vocab, hidden]);
every other parameter is replicated. DTensor splits like `torch.chunk`: ceil(n / k) rows per rank, the
last ranks get what is left.

FSDP2 then splits dim 0 of what TP left over `dp_shard` (HSDP replicates over `dp_replicate`). Its
sharded storage is padded to ceil(n / k) rows on every rank (the all-gather needs equal parts), while
AdamW's moments are `zeros_like` the unpadded local view: `padded=True` counts the former.

Mixture-of-experts models: TP does not split the router or the experts (parallel/tp.py drops the family
plan's expert entries), so every TP rank holds all of them, like any replicated parameter. Expert parallelism
(parallel/ep.py) splits each fused expert weight [E, ...] on dim 0 over `ep` (E/ep whole experts per rank,
`ep` divides E; with TP, the same E/ep on every TP rank of the EP group) and leaves it out of FSDP2 and DDP:
it is never split over dp_shard.
"""

from __future__ import annotations

import math
import re

from isotrain.parallel.dims import ParallelDims

# parallel/tp.py styles -> (dim of the weight split over TP, dim of the bias split or None)
_STYLE_DIMS = {
    "colwise": (0, 0),
    "colwise_gather_output": (0, 0),
    "rowwise": (1, None),
    "rowwise_split_input": (1, None),
    "replicated_with_grad_allreduce": (None, None),
}


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of part `index` when `n` rows are split like torch.chunk (and DTensor's Shard)."""
    full = -(-n // parts)
    return max(0, min(full, n - index * full))


def tp_split_dims(model, config) -> dict[str, int | None]:
    """Parameter name -> the dim TP splits (None: replicated), for a Hugging Face causal LM built on meta."""
    from isotrain.parallel.tp import layer_plan

    prefix = getattr(model, "base_model_prefix", "model")
    base_prefix = f"{prefix}." if hasattr(model, prefix) else ""
    by_module: dict[str, tuple[int | None, int | None]] = {}
    names = [name for name, _ in model.named_modules()]
    for pattern, style in layer_plan(config).items():
        regex = re.compile("^" + re.escape(base_prefix + pattern).replace(r"\*", r"[^.]+") + "$")
        for name in names:
            if regex.match(name):
                by_module[name] = _STYLE_DIMS[style]
    module_names = {module: name for name, module in model.named_modules()}
    embedding = model.get_input_embeddings()
    if embedding is not None:  # (a later pipeline stage has none: parallel/pp.py)
        by_module[module_names[embedding]] = (0, None)  # vocabulary rows
    head = model.get_output_embeddings()
    if head is not None:
        by_module[module_names[head]] = (0, 0)  # column-parallel over the vocabulary
    dims = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        weight_dim, bias_dim = by_module.get(module, (None, None))
        dims[name] = weight_dim if leaf == "weight" else bias_dim if leaf == "bias" else None
    return dims


def expert_parameter_names(model) -> set[str]:
    """Names of the fused expert weights that expert parallelism splits (parallel/ep.py)."""
    from isotrain.parallel.ep import EXPERT_PARAMS, expert_modules

    return {f"{name}.{key}" for name in expert_modules(model) for key in EXPERT_PARAMS}


def local_numel(shape: tuple[int, ...], tp_dim: int | None, degrees: ParallelDims, tp_rank: int = 0,
                shard_rank: int = 0, padded: bool = True, expert: bool = False) -> int:
    """Elements of one parameter on the rank at (`tp_rank`, `shard_rank`); rank 0 holds the most.
    `expert`: a fused expert weight, which `degrees.ep` > 1 splits instead of FSDP2."""
    local = list(shape)
    if expert and degrees.ep > 1:
        local[0] //= degrees.ep
        return math.prod(local)
    if degrees.tp > 1 and tp_dim is not None:
        local[tp_dim] = chunk_size(local[tp_dim], degrees.tp, tp_rank)
    if degrees.fsdp and local:
        rows = local[0]
        local[0] = -(-rows // degrees.dp_shard) if padded else chunk_size(rows, degrees.dp_shard, shard_rank)
    return math.prod(local)
