"""The parallel degrees of a run, resolved from the config and checked in plain Python before any work.

    world size = dp_replicate × dp_shard × tp          DP size = dp_replicate × dp_shard

`ep` and `cp` have their place here but only 1 is accepted until expert and context parallelism land.
Every check names the setting and the model's own numbers, so a wrong degree is one sentence at start-up
instead of a shape error deep inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from isotrain.errors import ConfigError

DEGREE_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp * self.cp

    def as_rows(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in DEGREE_NAMES]


def resolve_dims(cfg, world_size: int) -> ParallelDims:
    """Fill the one `-1` degree of `cfg` (a ParallelConfig) from the world size; the product must equal it."""
    degrees = {name: getattr(cfg, name) for name in DEGREE_NAMES}
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value} is invalid; use a positive degree or -1 for 'the rest'")
    auto = [name for name, value in degrees.items() if value == -1]
    if len(auto) > 1:
        raise ConfigError(
            f"parallel.{auto[0]} and parallel.{auto[1]} are both -1; at most one degree can take the remaining ranks"
        )
    fixed = 1
    for value in degrees.values():
        fixed *= value if value != -1 else 1
    if auto:
        if world_size % fixed:
            named = [f"parallel.{name}={value}" for name, value in degrees.items() if value not in (-1, 1)]
            needs = " × ".join(named) + (f" = {fixed}" if len(named) > 1 else "")
            launched = f"{world_size} process was" if world_size == 1 else f"{world_size} processes were"
            raise ConfigError(
                f"{needs} needs a multiple of {fixed} processes, but {launched} launched; launch a multiple of "
                f"{fixed} (torchrun --nproc-per-node {fixed}) or lower {'that degree' if len(named) == 1 else 'those degrees'}"
            )
        degrees[auto[0]] = world_size // fixed
    dims = ParallelDims(**degrees)
    if dims.world_size != world_size:
        product = " × ".join(str(getattr(dims, n)) for n in DEGREE_NAMES)
        launch = (f"launch {dims.world_size} processes (torchrun --nproc-per-node {dims.world_size})"
                  if world_size < dims.world_size else "make the product equal the number of processes")
        launched = f"{world_size} process was" if world_size == 1 else f"{world_size} processes were"
        raise ConfigError(
            f"parallel.dp_replicate × dp_shard × tp = {product} = {dims.world_size} but {launched} launched; {launch}"
        )
    return dims


def _multiple_hint(value: int, tp: int) -> str:
    return f"{value // tp * tp or tp} or {value // tp * tp + tp}"


def check_model_fits(dims: ParallelDims, config, check_vocab: bool = True) -> None:
    """Tensor parallelism splits attention heads, KV heads, the MLP width and the vocabulary into `tp` equal
    parts; refuse a model whose numbers do not divide, naming them (config: a transformers PretrainedConfig)."""
    if dims.tp == 1:
        return
    tp = dims.tp
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    checks = [
        ("num_attention_heads", heads, "attention heads"),
        ("num_key_value_heads", kv_heads, "key/value heads"),
        ("intermediate_size", getattr(config, "intermediate_size", None), "MLP width"),
    ]
    for field, value, what in checks:
        if value is not None and value % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide the model's {what} ({field}={value}); use a parallel.tp that "
                f"divides {value}, or a model with {field} a multiple of {tp}"
            )
    vocab = getattr(config, "vocab_size", None)
    if check_vocab and vocab is not None and vocab % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the vocabulary (vocab_size={vocab}), which tensor parallelism splits "
            f"over {tp} ranks; set model.config.vocab_size to a multiple of {tp} (e.g. {_multiple_hint(vocab, tp)}) "
            "for a fresh model, or use a parallel.tp that divides it"
        )
