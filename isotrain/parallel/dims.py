"""The parallel degrees of a run, resolved from the config and checked in plain Python before any work.

    world size = pp × dp_replicate × dp_shard × cp × tp          DP size = dp_replicate × dp_shard

`ep` (expert parallel) takes no ranks of its own: its groups are carved out of the DP ranks, so it must
divide the DP size, and each of the `ep` ranks of a group holds 1/ep of every MoE layer's experts
(parallel/ep.py); with tensor parallelism there is one such group per TP coordinate (ep × tp composes).
`cp` (context parallel) takes ranks of its own, like `tp`: the `cp` ranks of a DP rank hold the same micro-batches
and each runs one piece of every sequence (parallel/cp.py); Ulysses exchanges attention heads, so `cp` must divide
the heads, and the key/value heads or be a multiple of them (KV heads are then repeated); ring attention passes
key/value blocks around the ranks and has no condition on the heads. With TP, the CP ranks of a TP rank attend
over its heads. With EP the EP groups are carved out of the DP ranks of each CP coordinate (and TP coordinate,
parallel/mesh.py); an MoE model's router terms sum their loads over DP × CP.
FSDP2 shards over `dp_shard` ranks when it is above 1, and also over a single rank when a one-process torchrun
launch asks for `dp_shard=-1` (`shard_one_rank`): the same sharded code path as on many GPUs, on one.
`pp` (pipeline parallel) takes ranks of its own, outermost: each of the `pp` ranks of a pipeline holds one stage, an
even share of the decoder layers or the counts of `pp_split` (parallel/pp.py), and every stage runs every
micro-batch, so the DP size does not change with it. It composes with data, tensor and expert parallelism (a
`pp × dp × tp` mesh: DDP, FSDP2 or HSDP over the ranks of each stage, TP inside it, EP groups carved out of each
stage's DP ranks); CP beside it, and the zero-bubble schedules beside FSDP2, are refused (`check_pp`,
`resolve_dims`), and it needs a model that has at least `pp` decoder layers, `pp × pp_stages_per_rank` under the
several-stage schedules (`check_pp_fits`; an MoE model too, on any schedule). Under the interleaved schedule beside
FSDP2 each stage of a rank is an FSDP2 root of its own.
Every check names the setting and the model's own numbers, so a wrong degree is one sentence at start-up
instead of a shape error deep inside a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from isotrain.errors import ConfigError

DEGREE_NAMES = ("dp_replicate", "dp_shard", "tp")  # the degrees that may be -1 ("the rest")
WORLD_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # every degree that takes ranks, in the mesh's order
# The pipeline schedules that are built (parallel/pp.py); those after the first two run several stages per rank.
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, placed in a V: rank r holds stages r and 2·pp - 1 - r


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another torch elastic launcher) started this process, whatever the world size."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job's workers; 0 on a first start or without it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1
    shard_one_rank: bool = False  # dp_shard=-1 on a one-process torchrun launch: FSDP2 over that rank
    pp: int = 1
    pp_schedule: str = "1f1b"
    cp_style: str = "ulysses"
    pp_stages_per_rank: int = 1  # interleaved_1f1b: the stages each rank of a pipeline holds
    pp_split: tuple[int, ...] | None = None  # decoder layers of each of the pp_stages stages; None: an even split

    @property
    def pp_stages(self) -> int:
        """The stages of a pipeline: pp ranks, each holding pp_stages_per_rank of them."""
        return self.pp * self.pp_stages_per_rank

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 wraps the model."""
        return self.dp_shard > 1 or self.shard_one_rank

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp * self.cp * self.pp

    def as_rows(self) -> list[tuple[str, int]]:
        rows = [(name, getattr(self, name)) for name in DEGREE_NAMES]
        rows += [("ep", self.ep)] if self.ep > 1 else []
        rows += [("cp", self.cp)] if self.cp > 1 else []
        return rows + [("pp", self.pp)] if self.pp > 1 else rows


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
    cp = getattr(cfg, "cp", 1)
    pp, schedule = getattr(cfg, "pp", 1), getattr(cfg, "pp_schedule", "1f1b")
    per_rank = getattr(cfg, "pp_stages_per_rank", 1)
    split = getattr(cfg, "pp_split", None)
    check_pp(pp, schedule, {"cp": cp}, per_rank)
    check_pp_split(pp, per_rank, split)
    fixed = cp * pp
    for value in degrees.values():
        fixed *= value if value != -1 else 1
    if auto:
        if world_size % fixed:
            named = [f"parallel.{name}={value}" for name, value in [("pp", pp), *degrees.items(), ("cp", cp)]
                     if value not in (-1, 1)]
            needs = " × ".join(named) + (f" = {fixed}" if len(named) > 1 else "")
            launched = f"{world_size} process was" if world_size == 1 else f"{world_size} processes were"
            raise ConfigError(
                f"{needs} needs a multiple of {fixed} processes, but {launched} launched; launch a multiple of "
                f"{fixed} (torchrun --nproc-per-node {fixed}) or lower {'that degree' if len(named) == 1 else 'those degrees'}"
            )
        degrees[auto[0]] = world_size // fixed
    # One torchrun process joins a process group of one (parallel/dist.py), so dp_shard=-1 can shard over it.
    one_rank = cfg.dp_shard == -1 and degrees["dp_shard"] == 1 and launched_by_torchrun()
    dims = ParallelDims(**degrees, ep=getattr(cfg, "ep", 1), cp=cp, shard_one_rank=one_rank, pp=pp,
                        pp_schedule=schedule, cp_style=getattr(cfg, "cp_style", "ulysses"),
                        pp_stages_per_rank=per_rank, pp_split=tuple(split) if split is not None else None)
    if dims.pp_stages_per_rank > 1 and dims.fsdp and schedule != "interleaved_1f1b":
        raise ConfigError(f"parallel.pp_schedule={schedule} with FSDP2 (parallel.dp_shard={cfg.dp_shard}) is "
                          "not supported yet; set parallel.dp_shard=1 and use parallel.dp_replicate for the other "
                          "ranks, or parallel.pp_schedule=interleaved_1f1b")
    if dims.world_size != world_size:
        names = [n for n in WORLD_NAMES if n not in ("cp", "pp") or getattr(dims, n) > 1]
        product = " × ".join(str(getattr(dims, n)) for n in names)
        launch = (f"launch {dims.world_size} processes (torchrun --nproc-per-node {dims.world_size})"
                  if world_size < dims.world_size else "make the product equal the number of processes")
        launched = f"{world_size} process was" if world_size == 1 else f"{world_size} processes were"
        raise ConfigError(
            f"parallel.{' × '.join(names)} = {product} = {dims.world_size} but {launched} launched; {launch}"
        )
    check_ep(dims)
    return dims


def check_pp(pp: int, schedule: str, others: dict[str, int], per_rank: int = 1) -> None:
    """What pipeline parallelism is built for: the `1f1b` and `gpipe` schedules with one stage per rank,
    `interleaved_1f1b` with several (`per_rank`, parallel.pp_stages_per_rank), beside data and tensor parallelism
    (`others`: the degrees that would need their reductions and meshes carved per stage; expert parallelism has its
    EP groups carved per stage: parallel/mesh.py)."""
    if pp == 1:
        if per_rank != 1:
            raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} needs a pipeline; set parallel.pp to 2 or "
                              "more, or parallel.pp_stages_per_rank=1")
        return
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={schedule} is not built yet; set parallel.pp_schedule to one of "
                          f"{', '.join(PP_SCHEDULES)}")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"parallel.pp_schedule={schedule} runs exactly 2 stages on each rank (rank r holds stages r "
                          f"and 2·pp - 1 - r), but parallel.pp_stages_per_rank={per_rank}; set "
                          "parallel.pp_stages_per_rank=2")
    if schedule in MULTI_STAGE and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule={schedule} runs several stages on each rank, but "
                          f"parallel.pp_stages_per_rank={per_rank}; set parallel.pp_stages_per_rank=2 or more, or "
                          "parallel.pp_schedule=1f1b")
    if schedule not in MULTI_STAGE and per_rank != 1:
        raise ConfigError(f"parallel.pp_stages_per_rank={per_rank} needs parallel.pp_schedule=interleaved_1f1b "
                          f"(parallel.pp_schedule={schedule} runs one stage per rank); set parallel.pp_schedule="
                          "interleaved_1f1b or parallel.pp_stages_per_rank=1")
    for name, value in others.items():
        if value not in (1, -1):
            raise ConfigError(f"parallel.pp={pp} with parallel.{name}={value} is not supported yet (pipeline "
                              "parallelism composes with data, tensor and expert parallelism only); set "
                              f"parallel.{name}=1 and use parallel.dp_shard, parallel.dp_replicate or parallel.tp for "
                              "the other ranks, or parallel.pp=1")


def check_pp_split(pp: int, per_rank: int, split) -> None:
    """parallel.pp_split: one positive layer count per stage, pp × pp_stages_per_rank of them in stage order (their
    sum is checked against the model's layers in `check_pp_fits`)."""
    if split is None:
        return
    shown = "[" + ",".join(str(n) for n in split) + "]"
    if pp == 1:
        raise ConfigError(f"parallel.pp_split={shown} needs a pipeline; set parallel.pp to 2 or more, or "
                          "parallel.pp_split=null")
    stages = pp * per_rank
    if len(split) != stages:
        raise ConfigError(f"parallel.pp_split={shown} has {len(split)} entries, but the pipeline has parallel.pp="
                          f"{pp} × parallel.pp_stages_per_rank={per_rank} = {stages} stages; give one decoder-layer "
                          f"count per stage ({stages} entries), or parallel.pp_split=null for an even split")
    bad = [stage for stage, n in enumerate(split) if n < 1]
    if bad:
        raise ConfigError(f"parallel.pp_split={shown} gives stage {bad[0]} {split[bad[0]]} decoder layers, and every "
                          "stage needs at least one; make every entry a positive count")


def check_ep(dims: ParallelDims) -> None:
    """The expert-parallel groups are `ep` consecutive DP ranks, so `ep` must divide the DP size."""
    if dims.ep == 1:  # (the config refuses ep < 1)
        return
    if dims.dp_size % dims.ep:
        raise ConfigError(
            f"parallel.ep={dims.ep} does not divide the data-parallel size dp_replicate × dp_shard = "
            f"{dims.dp_replicate} × {dims.dp_shard} = {dims.dp_size}, out of which the expert-parallel groups are "
            f"carved; use a parallel.ep that divides {dims.dp_size}, or launch a multiple of {dims.ep} data-parallel ranks"
        )


# The one rule for "is this a mixture-of-experts model", used by parallelism, checkpoints and the router terms:
# its config names a positive number of routed experts. transformers' families spell it `num_experts` (Qwen2/3-MoE,
# OLMoE, Jamba, Switch), `num_local_experts` (Mixtral, PhiMoE, GraniteMoE, GPT-OSS, Llama 4) or `n_routed_experts`
# (DeepSeek V2/V3); a config object answers the other spellings through its attribute map, a config.json dict
# does not. `num_experts_per_tok` (top-k) does not decide it: it describes the router, and Switch Transformers
# routes to one expert with no such field; a config with experts but no top-k is still MoE.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_experts(config) -> int | None:
    """E, the number of routed experts per MoE layer, of a transformers config (or config.json as a dict);
    None for a dense model."""
    for field in EXPERT_COUNT_FIELDS:
        value = config.get(field) if isinstance(config, dict) else getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def is_moe(config) -> bool:
    """Whether a transformers config (or config.json dict) describes a mixture-of-experts model."""
    return num_experts(config) is not None


def _check_experts_fit(ep: int, config) -> None:
    if ep == 1:
        return
    experts = num_experts(config)
    model_type = getattr(config, "model_type", "?")
    if experts is None:
        raise ConfigError(
            f"parallel.ep={ep} splits a mixture-of-experts model's experts, but model type {model_type!r} is dense "
            "(its config has no num_experts or num_local_experts); set parallel.ep=1"
        )
    if experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the model's {experts} experts; use a parallel.ep that divides "
            f"{experts} (and the data-parallel size)"
        )


def has_dense_mlp(config) -> bool:
    """Whether some decoder layer has a dense MLP, which TP splits (a MoE model's experts are not split by TP:
    Qwen-MoE families make the layers in `mlp_only_layers`, or off the `decoder_sparse_step`, dense)."""
    if num_experts(config) is None:
        return True
    return bool(getattr(config, "mlp_only_layers", None)) or (getattr(config, "decoder_sparse_step", 1) or 1) > 1


def _multiple_hint(value: int, tp: int) -> str:
    return f"{value // tp * tp or tp} or {value // tp * tp + tp}"


def check_model_fits(dims: ParallelDims, config, check_vocab: bool = True) -> None:
    """Tensor parallelism splits attention heads, KV heads, the dense MLP width and the vocabulary into `tp`
    equal parts (not a MoE model's experts: they are replicated over TP), and expert parallelism splits the
    experts into `ep` parts; refuse a model whose numbers do not divide, naming them (config: a transformers
    PretrainedConfig)."""
    _check_experts_fit(dims.ep, config)
    check_pp_fits(dims.pp, config, dims.pp_stages_per_rank, dims.pp_split)
    if dims.tp > 1:
        _check_tp_fits(dims.tp, config, check_vocab)
    check_cp_fits(dims.cp, config, dims.cp_style, dims.tp)  # after TP's: Ulysses splits each TP rank's heads


def _check_tp_fits(tp: int, config, check_vocab: bool) -> None:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    checks = [
        ("num_attention_heads", heads, "attention heads"),
        ("num_key_value_heads", kv_heads, "key/value heads"),
    ]
    if has_dense_mlp(config):
        checks.append(("intermediate_size", getattr(config, "intermediate_size", None), "MLP width"))
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


def check_cp_fits(cp: int, config, style: str = "ulysses", tp: int = 1) -> None:
    """Ulysses gives each of the `cp` ranks heads / cp whole query heads over the whole sequence: `cp` divides the
    heads (with TP, the heads / tp of a TP rank, checked divisible by TP before); the KV heads are split the same
    way, or repeated up to `cp` when there are fewer (then `cp` must be a multiple of them, so that each rank's
    query heads share one KV head). Ring attention keeps every head of its TP rank on every CP rank (any `cp`), and
    computes its blocks without dropout. Attention over whole sequences knows no sliding window: refused."""
    if cp == 1:
        return
    if style == "ring":
        dropout = getattr(config, "attention_dropout", 0.0) or 0.0
        if dropout > 0:
            raise ConfigError(f"parallel.cp_style=ring computes attention without dropout, and this model has "
                              f"attention_dropout={dropout}; set model.config.attention_dropout=0 or "
                              "parallel.cp_style=ulysses")
        _check_cp_model(cp, config)
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if tp > 1:
        _check_ulysses_tp_heads(cp, tp, heads, kv_heads)
    elif heads is not None and heads % cp:
        raise ConfigError(f"parallel.cp={cp} does not divide the model's attention heads (num_attention_heads="
                          f"{heads}), which Ulysses splits over the context-parallel ranks; use a parallel.cp that "
                          f"divides {heads}, or parallel.cp_style=ring")
    elif kv_heads is not None and kv_heads % cp and cp % kv_heads:
        raise ConfigError(f"parallel.cp={cp} neither divides nor is a multiple of the model's key/value heads "
                          f"(num_key_value_heads={kv_heads}); use a parallel.cp that divides {kv_heads} or is a "
                          f"multiple of it, or parallel.cp_style=ring")
    _check_cp_model(cp, config)


def _check_ulysses_tp_heads(cp: int, tp: int, heads: int | None, kv_heads: int | None) -> None:
    """Under TP, Ulysses splits the heads of one TP rank (heads / tp, KV heads / tp) over the CP ranks."""
    if heads is not None and (heads // tp) % cp:
        raise ConfigError(f"parallel.cp={cp} does not divide the attention heads of a tensor-parallel rank "
                          f"(num_attention_heads={heads} / parallel.tp={tp} = {heads // tp}), which Ulysses splits "
                          f"over the context-parallel ranks; use a parallel.cp that divides {heads // tp} or "
                          "parallel.cp_style=ring")
    local_kv = kv_heads // tp if kv_heads is not None else None
    if local_kv is not None and local_kv % cp and cp % local_kv:
        raise ConfigError(f"parallel.cp={cp} neither divides nor is a multiple of the key/value heads of a "
                          f"tensor-parallel rank (num_key_value_heads={kv_heads} / parallel.tp={tp} = {local_kv}); "
                          f"use a parallel.cp that divides {local_kv} or is a multiple of it, or "
                          "parallel.cp_style=ring")


def _check_cp_model(cp: int, config) -> None:
    """What neither CP style is built for: a sliding window. (A mixture-of-experts model's router terms are summed
    over the CP ranks' pieces: isotrain/moe/objective.py.)"""
    if getattr(config, "sliding_window", None):
        raise ConfigError(f"parallel.cp={cp} attends over whole sequences, and this {config.model_type} model has a "
                          f"sliding window of {config.sliding_window} tokens; set parallel.cp=1")


def check_pp_fits(pp: int, config, per_rank: int = 1, split=None) -> None:
    """Each stage needs at least one decoder layer. An MoE model's stages each form the router terms of their own
    layers against the pool of all layers (train/pipeline_step.py), on any schedule (a rank of several stages: each
    held stage's); a stage whose layers are all dense adds no term.
    (Tied input and output embeddings are kept on the first and the last stage, one copy each: parallel/pp.py.)"""
    if pp == 1:
        return
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers < pp:
        raise ConfigError(f"parallel.pp={pp} needs at least {pp} decoder layers, one per stage, but the model has "
                          f"{layers} (num_hidden_layers={layers}); use a parallel.pp of at most {layers}")
    stages = pp * per_rank
    if split is not None and layers is not None and sum(split) != layers:
        shown = "[" + ",".join(str(n) for n in split) + "]"
        raise ConfigError(f"parallel.pp_split={shown} places {sum(split)} decoder layers, but the model has {layers} "
                          f"(num_hidden_layers={layers}); make the entries sum to {layers}")
    if layers is not None and layers < stages:
        fix = (f"use a parallel.pp_stages_per_rank of at most {layers // pp}" if layers // pp >= 2
               else "use parallel.pp_schedule=1f1b with parallel.pp_stages_per_rank=1")
        raise ConfigError(f"parallel.pp={pp} × parallel.pp_stages_per_rank={per_rank} = {stages} stages need at "
                          f"least {stages} decoder layers, one per stage, but the model has {layers} "
                          f"(num_hidden_layers={layers}); {fix}")
