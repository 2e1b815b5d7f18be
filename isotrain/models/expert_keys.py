"""Mixture-of-experts weights under the keys `save_pretrained` writes: one tensor per expert, global ids.

In transformers 5 the experts of a MoE block are two fused parameters in memory,

    <layer>.mlp.experts.gate_up_proj   [E, 2I, H]   rows [0, I) the gate projection, [I, 2I) the up projection
    <layer>.mlp.experts.down_proj      [E, H, I]

while `save_pretrained` (and every published checkpoint of these families) stores each expert on its own:

    qwen2_moe, qwen3_moe, olmoe:  <layer>.mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight
    mixtral:                      <layer>.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight  (w1 gate, w3 up, w2 down),
                                  and every other `.mlp.` key of the block as `.block_sparse_moe.` (its router)

Each saved key is one block of a fused parameter: expert e's gate is `gate_up_proj[e, :I, :]`, its up
`gate_up_proj[e, I:, :]`, its down `down_proj[e]`. A `Part` names that block (`box`, in the fused tensor's
coordinates), so a rank holding any block of the fused tensor (FSDP2 or expert-parallel `Shard(0)` over
experts, TP) writes and reads the parts it holds by their global expert id, whatever its layout.

The table below is small and explicit on purpose: transformers' own conversion rules live in a module
that changes between releases; tests/models/test_expert_keys.py checks every family against
`save_pretrained` of a freshly built model (key set, shapes, values).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]

# In-memory names of the fused expert parameters (the same in every family listed below).
_FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertFormat:
    """How one model family stores its experts on disk."""

    block: str  # the MoE block's module name in saved keys ("mlp" in memory for every family)
    gate: str  # per-expert leaf names: gate, up and down projections
    up: str
    down: str

    def key(self, layer: str, expert: int, leaf: str) -> str:
        return f"{layer}.{self.block}.experts.{expert}.{leaf}.weight"

    def expert_key(self) -> re.Pattern:
        """Matches a per-expert saved key: groups layer, expert, leaf."""
        leaves = "|".join(re.escape(leaf) for leaf in (self.gate, self.up, self.down))
        return re.compile(rf"^(?P<layer>.+)\.{re.escape(self.block)}\.experts\.(?P<expert>\d+)\.(?P<leaf>{leaves})"
                          r"\.weight$")


_QWEN = ExpertFormat("mlp", "gate_proj", "up_proj", "down_proj")
FORMATS: dict[str, ExpertFormat] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "olmoe": _QWEN,
    "mixtral": ExpertFormat("block_sparse_moe", "w1", "w3", "w2"),
}


def expert_format(config) -> ExpertFormat | None:
    """The family's on-disk expert format from a transformers config (or config.json as a dict); None for a
    model without fused experts (dense models keep their names unchanged)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return FORMATS.get(model_type)


@dataclass(frozen=True)
class Part:
    """One saved tensor that holds the block `box` of an in-memory tensor.

    `drop_first`: the saved tensor is the block without its leading (expert) dim, [I, H] rather than [1, I, H].
    A tensor saved whole has one part with the full box.
    """

    key: str
    box: Box
    drop_first: bool = False
    expert: int | None = None  # the global expert id of an expert's part

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = tuple(stop - start for start, stop in self.box)
        return sizes[1:] if self.drop_first else sizes


def _full(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def saved_name(name: str, fmt: ExpertFormat | None) -> str:
    """The saved key of a tensor that is stored whole: mixtral's MoE block is `block_sparse_moe` on disk."""
    if fmt is None or fmt.block == "mlp":
        return name
    return name.replace(".mlp.", f".{fmt.block}.")


def saved_parts(name: str, shape: tuple[int, ...], fmt: ExpertFormat | None) -> list[Part]:
    """The saved tensors of the in-memory tensor `name` of `shape`, in file order (expert by expert)."""
    shape = tuple(shape)
    match = _FUSED.match(name) if fmt is not None else None
    if match is None or len(shape) != 3:
        return [Part(saved_name(name, fmt), _full(shape))]
    layer, (num, rows, cols) = match["layer"], shape
    if match["which"] == "down_proj":
        return [Part(fmt.key(layer, e, fmt.down), ((e, e + 1), (0, rows), (0, cols)), True, e) for e in range(num)]
    if rows % 2:
        raise ValueError(f"{name} has {rows} rows, which cannot be split into gate and up halves")
    half = rows // 2
    return [Part(fmt.key(layer, e, leaf), ((e, e + 1), span, (0, cols)), True, e)
            for e in range(num) for leaf, span in ((fmt.gate, (0, half)), (fmt.up, (half, rows)))]


def fused_name(key: str, fmt: ExpertFormat) -> tuple[str, int] | None:
    """(in-memory fused name, expert id) of a per-expert saved key; None for any other key."""
    match = fmt.expert_key().match(key)
    if match is None:
        return None
    which = "down_proj" if match["leaf"] == fmt.down else "gate_up_proj"
    return f"{match['layer']}.mlp.experts.{which}", int(match["expert"])


def is_fused(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `name` is a fused expert tensor (as older isotrain checkpoints stored it)."""
    return _FUSED.match(name) is not None and len(shape) == 3


def key_problems(counts: Counter, num: int, fmt: ExpertFormat) -> list[str]:
    """One sentence per problem with the per-expert keys of a set of model files.

    `counts`: how many model files hold each key (a key held twice is an expert written twice, e.g. by two
    expert-parallel ranks that numbered their local experts from 0). For every layer with expert keys, each
    of the `num` experts must have its three projections exactly once, no expert id may reach `num`, and the
    fused tensor of the same layer may not be stored beside them.
    """
    pattern = fmt.expert_key()
    layers: dict[str, set[str]] = {}
    problems = []
    for key, count in sorted(counts.items()):
        match = pattern.match(key)
        if match is None:
            continue
        layers.setdefault(match["layer"], set()).add(key)
        if count > 1:
            problems.append(f"expert tensor {key!r} is stored {count} times (an expert is duplicated)")
        if int(match["expert"]) >= num:
            problems.append(f"expert tensor {key!r} names expert {match['expert']}, but the model has {num} experts "
                            f"(ids 0-{num - 1})")
    for layer, present in sorted(layers.items()):
        for e in range(num):
            for leaf in (fmt.gate, fmt.up, fmt.down):
                if fmt.key(layer, e, leaf) not in present:
                    problems.append(f"expert tensor {fmt.key(layer, e, leaf)!r} is missing (expert {e} of {num})")
        for which in ("gate_up_proj", "down_proj"):
            if f"{layer}.mlp.experts.{which}" in counts:
                problems.append(f"{layer}.mlp.experts.{which!s} is stored beside the per-expert tensors of "
                                "the same experts (an expert is duplicated)")
    return problems


def layers_with_experts(keys: Iterable[str], fmt: ExpertFormat) -> tuple[dict[str, set[int]], set[str]]:
    """({layer: expert ids found} of per-expert keys, {names of fused expert tensors}), for inspect."""
    pattern = fmt.expert_key()
    found: dict[str, set[int]] = {}
    fused = set()
    for key in keys:
        match = pattern.match(key)
        if match is not None:
            found.setdefault(match["layer"], set()).add(int(match["expert"]))
        elif _FUSED.match(key):
            fused.add(key)
    return found, fused
