"""Per-rank memory of an SFT run, from its config alone: no tokenizer training, no data, no weights read.

Model states come from the model built on the meta device, one parameter at a time (memory/shards.py):

    parameters     = Σ local elements × storage itemsize (+ one fp32 scale per tensor for float8)
    masters        = Σ local elements × 4 when parameters are stored below fp32 (float8); fp32 and bf16 runs
                     keep fp32 parameters, which are the masters themselves
    gradients      = Σ local elements × 4 (FSDP2 reduces in fp32; autocast grads of fp32 leaves are fp32)
    AdamW moments  = Σ unpadded local elements × 4 × 2 (exp_avg, exp_avg_sq) + 4 bytes of `step` per tensor

Activations, compute copies and the logits/loss tensors come from one fake-tensor forward of a full
micro-batch (train.micro_batch_size × data.max_seq_len, memory/fake_forward.py). The logits (compute dtype)
and, when they are not fp32, their fp32 upcast by the loss exist at once at the end of the forward. With
train.loss_chunk_tokens the logits term is one chunk's instead, beside the hidden states the chunks keep
(memory/saved.py `chunked_loss_fn`).

FSDP2 (dp_shard > 1, or -1 on one torchrun process) adds its buffers, in the dtype it computes in
(`fsdp_terms`): the root's unsharded parameters (embeddings, final norm, head: not resharded after forward)
beside one group's flat all-gather output and one group's unsharded parameters; one layer's unsharded gradients
with their fp32 reduce-scatter input, beside the head's gradients, which wait for the root's reduce at the end of
backward.

Mixture-of-experts models: under expert parallelism (`parallel.ep`) each rank holds E/ep whole experts of every
fused expert weight, outside FSDP2 (not sharded, not padded, not in its buffers); the fake forward routes the
experts as if every expert got the same share of the tokens (memory/fake_experts.py), and the router terms of
the objective count on their own (docs/memory.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch

from isotrain.config import RLRunConfig, TrainRunConfig
from isotrain.errors import ConfigError
from isotrain.memory.fake_cp import piece_length
from isotrain.memory.fsdp_buffers import fsdp_terms
from isotrain.memory.terms import DTYPES, Term, meta_model, model_state_terms
from isotrain.parallel.dims import ParallelDims

EXCHANGE_NOTES = {"ulysses": "one all-to-all's send + receive buffers (the largest: q or the output, heads × L/cp), "
                             "while attention runs",
                  "ring": "backward's key/value block held + arriving, beside their dK, dV travelling + arriving "
                          "(fp32 at least), while attention runs"}


@dataclass
class MemoryEstimate:
    """The terms of one rank; under pipeline parallelism those of the stage `settings["stage"]` (the largest
    unless asked), and every stage's in `stages`."""
    settings: dict
    terms: list[Term] = field(default_factory=list)
    stages: list[list[Term]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(term.bytes for term in self.terms)

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)

    def as_json(self) -> str:
        report = {"settings": self.settings, "terms": [asdict(t) for t in self.terms], "total_bytes": self.total_bytes}
        if self.stages:
            report["stages"] = [{"stage": index, "terms": [asdict(t) for t in terms],
                                 "total_bytes": sum(t.bytes for t in terms)} for index, terms in enumerate(self.stages)]
        return json.dumps(report, indent=2)


def activation_terms(cfg: TrainRunConfig, config, degrees: ParallelDims, dtype: str, device: str = "cpu") -> list[Term]:
    from isotrain.memory.fake_forward import fake_forward
    from isotrain.models.checks import attention_kernel
    from isotrain.moe.settings import router_settings
    from transformers import AutoModelForCausalLM

    _, compute = DTYPES[dtype]
    fsdp = degrees.fsdp
    lowp = compute != torch.float32
    checkpointing = cfg.train.activation_checkpointing == "full"
    kwargs = dict(micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.max_seq_len, tp=degrees.tp,
                  param_dtype=compute if fsdp else torch.float32,
                  autocast_dtype=compute if lowp and not fsdp else None, packed=cfg.data.packing)
    router = router_settings(cfg.moe, config)
    chunk = cfg.train.loss_chunk_tokens
    kwargs.update(ep=degrees.ep, router=router, chunk_tokens=chunk, device=device, cp=degrees.cp,
                  cp_style=degrees.cp_style)
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModelForCausalLM)
    saved = fake_forward(config, kernel, activation_checkpointing=checkpointing, **kwargs)
    upcast = saved.upcast_bytes
    tokens = f"{cfg.train.micro_batch_size} × {cfg.data.max_seq_len} tokens"
    if degrees.cp > 1:
        tokens = (f"{cfg.train.micro_batch_size} × {piece_length(cfg.data.max_seq_len, degrees.cp, degrees.cp_style)}"
                  f" tokens (this rank's piece of {cfg.data.max_seq_len}: CP {degrees.cp} {degrees.cp_style})")
    routing = ""
    if router is not None:
        routing = (f"; MoE: top-{router.top_k} of {router.num_experts} experts, "
                   + ("balanced routing (each rank receives as many rows as it sends)" if degrees.ep > 1
                      else "every (token, expert) pair one row, whatever the routing"))
    terms = [Term("activations", saved.by_kind["activations"], f"saved for backward, {tokens}"
                  + (", layer inputs only (checkpointing)" if checkpointing else "") + routing),
             Term("compute copies", saved.by_kind["compute_copies"], "autocast's low-precision weight copies"
                  + ("; EP: the local experts cast to the compute dtype" if degrees.ep > 1 and lowp else "")),
             Term("logits and loss", saved.by_kind["logits_loss"] + saved.logits_bytes + upcast,
                  (f"chunked ({chunk} tokens): the trained tokens' final hidden states + one chunk's head/loss "
                   "tensors and logits, as backward recomputes it" if chunk else "head/loss saved tensors + logits")
                  + (" + their fp32 upcast" if upcast else ""))]
    if router is not None:
        terms.append(Term("router logits and terms", saved.by_kind["router"],
                          "router logits kept for the aux / z-loss, their fp32 probabilities"))
    if degrees.cp > 1:
        terms.append(Term("context-parallel exchange buffers", saved.exchange_bytes, EXCHANGE_NOTES[degrees.cp_style]))
    if checkpointing:
        full = fake_forward(config, kernel, activation_checkpointing=False, **kwargs)
        body = lambda s: s.by_kind["activations"] + s.by_kind["compute_copies"]  # noqa: E731
        layers = config.num_hidden_layers
        terms.append(Term("recomputed layer", max(0, body(full) - body(saved)) // layers,
                          "one decoder layer's activations, rebuilt in backward"))
    return terms


def run_vocab_size(cfg: TrainRunConfig, config) -> tuple[int, str]:
    """The vocabulary the run will have, and how it was found (a trained tokenizer's size is its target)."""
    from isotrain.models.loading import tokenizer_dir
    from isotrain.models.tokenizer import holds_tokenizer, load_tokenizer

    source = tokenizer_dir(cfg)
    special = len(cfg.model.add_special_tokens)
    if source is not None and (cfg.tokenizer.path is not None or holds_tokenizer(source)):
        size = len(load_tokenizer(str(source))) + special
        return max(config.vocab_size or 0, size), "the tokenizer's"
    if source is not None:
        # A model directory with config.json alone (a dry run from a shipped config, or a Hub cache filled for one):
        # the run's vocabulary is max(vocab_size, tokenizer + new special tokens) <= vocab_size + special tokens
        # whenever the tokenizer fits the model's vocabulary, as a model's own tokenizer does.
        return (config.vocab_size or 0) + special, ("at most: the model config's vocab_size + model.add_special_tokens "
                                                    "(no tokenizer files beside config.json)")
    # A fresh model's vocabulary is the trained tokenizer's size (or more rows if model.config asks for them),
    # never transformers' default for the family.
    asked = (cfg.model.config or {}).get("vocab_size") or 0
    target = cfg.tokenizer.vocab_size + special
    if cfg.tokenizer.type == "char":
        return max(asked, target), ("a bound: a char tokenizer has one token per distinct character of the data, "
                                    "known once it is trained; tokenizer.vocab_size is used")
    return max(asked, target), "at most, as the tokenizer is trained on the data (tokenizer.vocab_size)"


def default_device() -> str:
    """The device a run started here computes on (parallel/dist.py): a GPU when one is visible."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def estimate_memory(cfg: TrainRunConfig, world_size: int, dtype: str | None = None, vocab_size: int | None = None,
                    checked=None, device: str | None = None, stage: int | None = None) -> MemoryEstimate:
    """Every term of one rank's memory (the largest rank: rank 0) for `cfg` on `world_size` processes computing on
    `device` ("cpu" or "cuda"; default: where a run started here would compute). The device decides the attention
    kernel, and with it what attention saves for backward (memory/fake_forward.py). Under pipeline parallelism
    every stage is estimated (memory/pipeline.py) and the terms are those of `stage`, by default the largest
    (under interleaved 1F1B: of pipeline rank `stage`, which holds several stages)."""
    from isotrain.models.loading import check_layout_fits, checked_config
    from isotrain.parallel.dims import check_model_fits, resolve_dims
    from isotrain.train.chunked_loss import check_chunked_loss_settings

    dtype = dtype or cfg.model.dtype
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} cannot be estimated; use cpu or cuda")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} cannot be estimated; use one of {', '.join(DTYPES)}")
    degrees = resolve_dims(cfg.parallel, world_size)
    if degrees.pp > 1:
        from isotrain.memory.pipeline import check_pipeline_estimate

        check_pipeline_estimate(cfg, degrees)
    config = checked if checked is not None else checked_config(cfg)
    check_layout_fits(cfg.model, degrees)
    how = "given"
    if vocab_size is None:
        vocab_size, how = run_vocab_size(cfg, config)
    config.vocab_size = vocab_size
    check_model_fits(degrees, config)
    check_chunked_loss_settings(cfg.train.loss_chunk_tokens, degrees.tp)
    model = meta_model(cfg, config)
    settings = {"world_size": world_size, **dict(degrees.as_rows()), "dtype": dtype, "device": device,
                "micro_batch_size": cfg.train.micro_batch_size, "max_seq_len": cfg.data.max_seq_len,
                "activation_checkpointing": cfg.train.activation_checkpointing,
                "loss_chunk_tokens": cfg.train.loss_chunk_tokens,
                **({"cp_style": degrees.cp_style} if degrees.cp > 1 else {}),
                "vocab_size": vocab_size, "vocab_size_source": how, **_step_settings(cfg),
                "parameters": sum(p.numel() for p in model.parameters())}
    if degrees.pp > 1:
        return _pipeline_estimate(cfg, config, degrees, dtype, device, settings, stage)
    sharding = _sharding(degrees)
    terms = [*model_state_terms(model, config, sharding, dtype), *fsdp_terms(model, config, sharding, dtype),
             *activation_terms(cfg, config, degrees, dtype, device)]
    return MemoryEstimate(settings, terms)


def _sharding(degrees: ParallelDims) -> ParallelDims:
    """The degrees that split the model states: under context parallelism FSDP2 shards over dp_shard × cp
    (parallel/mesh.py), so a CP rank holds 1/(dp_shard·cp) of the weights and AdamW state."""
    if degrees.cp == 1 or not degrees.fsdp:
        return degrees
    return replace(degrees, dp_shard=degrees.dp_shard * degrees.cp)


def _pipeline_estimate(cfg, config, degrees: ParallelDims, dtype: str, device: str, settings: dict,
                       stage: int | None) -> MemoryEstimate:
    """Every stage's terms; the estimate's own are those of `stage`, or of the largest stage."""
    from isotrain.memory.pipeline import stage_terms
    from isotrain.sizes import plan_batches

    if stage is not None and not 0 <= stage < degrees.pp:
        raise ConfigError(f"stage {stage} is not a stage of parallel.pp={degrees.pp}; use 0 to {degrees.pp - 1}")
    num_microbatches = plan_batches(cfg, degrees).grad_accum_steps
    stages = [stage_terms(cfg, config, degrees, dtype, device, index, num_microbatches) for index in range(degrees.pp)]
    totals = [sum(t.bytes for t in terms) for terms in stages]
    chosen = stage if stage is not None else totals.index(max(totals))
    settings.update(pp_schedule=degrees.pp_schedule, pp_stages_per_rank=degrees.pp_stages_per_rank,
                    pp_microbatches=num_microbatches, stage=chosen, stage_totals_bytes=totals)
    return MemoryEstimate(settings, stages[chosen], stages)


def _step_settings(cfg) -> dict:
    """Which step the estimate is of. RL's update runs the SFT step's shapes (micro-batch × data.max_seq_len
    prompt + response tokens, the logits of each for the log-probs), so the same terms hold for it; what RL
    holds beside the policy is not counted yet."""
    if not isinstance(cfg, RLRunConfig):
        return {"step": "sft"}
    return {"step": "rl policy update",
            "not_counted": "the rollout engine's own fp32 copy of the weights and its KV cache (rollout.batch_size "
                           "sequences), the frozen reference (rl.kl_coef > 0), PPO's critic"}


def memory_table(estimate: MemoryEstimate):
    from rich.table import Table

    if estimate.stages:
        return _stage_table(estimate)
    s = estimate.settings
    ep = f", ep {s['ep']}" if "ep" in s else ""
    ep += f", cp {s['cp']} ({s['cp_style']})" if "cp" in s else ""
    title = (f"per-rank memory (rank 0 of {s['world_size']}: dp_replicate {s['dp_replicate']}, dp_shard "
             f"{s['dp_shard']}, tp {s['tp']}{ep}; {s['dtype']} on {s['device']}; "
             f"micro-batch {s['micro_batch_size']} × {s['max_seq_len']}; step: {s['step']})")
    table = Table(title=title)
    table.add_column("term")
    table.add_column("MiB", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("how")
    for term in estimate.terms:
        table.add_row(term.name, f"{term.bytes / 2**20:,.2f}", f"{term.bytes:,}", term.note)
    table.add_row("total", f"{estimate.total_bytes / 2**20:,.2f}", f"{estimate.total_bytes:,}",
                  f"{s['parameters']:,} parameters; vocabulary {s['vocab_size']:,} ({s['vocab_size_source']})"
                  + (f"; not counted: {s['not_counted']}" if "not_counted" in s else ""))
    return table


def _stage_table(estimate: MemoryEstimate):
    """One column of MiB per pipeline stage (per pipeline rank under interleaved 1F1B: its stages together); the
    notes are the largest one's."""
    from rich.table import Table

    s = estimate.settings
    what = "stage" if s["pp_stages_per_rank"] == 1 else "rank"
    title = (f"per-rank memory of each pipeline {what} (pp {s['pp']}, {s['pp_schedule']}, {s['pp_microbatches']} "
             f"micro-batches; world {s['world_size']}, dp_replicate {s['dp_replicate']}, dp_shard {s['dp_shard']}, "
             f"tp {s['tp']}; {s['dtype']} on "
             f"{s['device']}; micro-batch {s['micro_batch_size']} × {s['max_seq_len']}; largest: {what} {s['stage']})")
    table = Table(title=title)
    table.add_column("term")
    for index in range(len(estimate.stages)):
        table.add_column(f"{what} {index} MiB", justify="right")
    table.add_column(f"how ({what} {s['stage']})")
    for row, term in enumerate(estimate.terms):
        table.add_row(term.name, *(f"{terms[row].bytes / 2**20:,.2f}" for terms in estimate.stages), term.note)
    table.add_row("total", *(f"{total / 2**20:,.2f}" for total in s["stage_totals_bytes"]),
                  f"{s['parameters']:,} parameters in all stages; vocabulary {s['vocab_size']:,} "
                  f"({s['vocab_size_source']})")
    return table
