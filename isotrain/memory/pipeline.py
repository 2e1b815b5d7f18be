"""Per-stage memory of a pipeline-parallel run (parallel.pp, parallel/pp.py): every stage's own terms.

Model states: the model built on meta and reduced to the stage by the run's own `apply_pp` (its decoder layers; the
input embedding on the first stage, the final norm and the head on the last, a tied embedding on both), counted as
for any rank (estimate.py `model_state_terms`).

Activations: one micro-batch's forward of the stage on fake tensors (fake_forward.py `fake_stage_forward`), times the
micro-batches whose backward has not run yet at the schedule's worst moment (`microbatches_in_flight`), with m the
batch plan's gradient-accumulation micro-batches (the pipeline's, isotrain/sizes.py):

    1f1b   stage s of p: min(p - s, m)   (torch's Schedule1F1B warms up with that many forwards, then
                                          alternates one backward and one forward)
    gpipe  m                             (every forward before the first backward)
    interleaved_1f1b                     rank r holds V stages (r, r + p, ...): the most bytes its stages' micro-
                                          batches hold at once in torch's own order of r's forwards and backwards
                                          (`interleaved_order`), the stages' sizes differing (embedding, head)

The logits (and the loss's saved tensors) of a micro-batch exist on the last stage only, once per micro-batch in
flight (the schedule keeps each stage output until its backward). Autocast's low-precision weight copies are made
once per step (the schedule runs in one autocast region, which caches them), not once per micro-batch.

Pipeline buffers (torch.distributed.pipelining's stage): a receive buffer per micro-batch for the hidden states
(every stage after the first) and for their gradients (every stage before the last), allocated when the schedule
is built and kept with it (parallel/pp.py `Pipeline` keeps the schedules of its last KEPT shapes); and the hidden
states a stage before the last sent on, kept until the micro-batch's backward.
"""

from __future__ import annotations

import torch

from isotrain.errors import ConfigError
from isotrain.memory.terms import DTYPES, FP32_BYTES, Term, meta_model, model_state_terms
from isotrain.parallel.dims import ParallelDims


def microbatches_in_flight(schedule: str, stage: int, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at most, on `stage` of a schedule with one
    stage per rank (see the docstring)."""
    if schedule == "gpipe":
        return num_microbatches
    return min(pp - stage, num_microbatches)


def interleaved_order(rank: int, pp: int, per_rank: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The forwards ("F") and backwards ("B") of (stage) that torch's ScheduleInterleaved1F1B runs on `rank`, in
    order: its own computation of the order (`_calculate_single_rank_operations`, which reads nothing but these
    sizes), as every rank of a real run computes it."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, num_microbatches // pp)
    sizes = SimpleNamespace(n_local_stages=per_rank, pp_group_size=pp, _n_microbatches=num_microbatches,
                            number_of_rounds=rounds, microbatches_per_round=num_microbatches // rounds)
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(sizes, rank)
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index) for a in actions if a is not None]


def peak_in_flight(degrees: ParallelDims, rank: int, num_microbatches: int, bytes_of: dict[int, int]) -> int:
    """The most bytes that the micro-batches in flight on `rank` hold at once, when one micro-batch of stage s
    holds `bytes_of[s]`: 1F1B and GPipe by their counts; interleaved 1F1B by walking torch's order."""
    if degrees.pp_stages_per_rank == 1:
        return microbatches_in_flight(degrees.pp_schedule, rank, degrees.pp, num_microbatches) * bytes_of[rank]
    held = peak = 0
    for kind, stage in interleaved_order(rank, degrees.pp, degrees.pp_stages_per_rank, num_microbatches):
        held += bytes_of[stage] if kind == "F" else -bytes_of[stage]
        peak = max(peak, held)
    return peak


def check_pipeline_estimate(cfg, degrees: ParallelDims) -> None:
    """The pipelines estimated: every schedule, beside DDP replicas (not FSDP2, TP or EP), for SFT."""
    from isotrain.config import RLRunConfig

    if degrees.fsdp or degrees.tp > 1 or degrees.ep > 1:
        named = (f"parallel.dp_shard={degrees.dp_shard}" if degrees.fsdp else f"parallel.tp={degrees.tp}"
                 if degrees.tp > 1 else f"parallel.ep={degrees.ep}")
        raise ConfigError(f"isotrain estimate-memory estimates pipeline stages beside DDP replicas only, not {named} "
                          f"(parallel.pp={degrees.pp}); estimate the stage's layout with parallel.pp=1, or the "
                          "pipeline with parallel.dp_shard=1, parallel.tp=1 and parallel.ep=1")
    if isinstance(cfg, RLRunConfig):
        raise ConfigError(f"isotrain estimate-memory estimates pipeline stages (parallel.pp={degrees.pp}) of SFT runs "
                          "only; estimate the RL run with parallel.pp=1")


def _stage_forwards(cfg, config, degrees: ParallelDims, dtype: str, device: str, stages: list[int],
                    checkpointing: bool) -> dict:
    """stage -> (SavedBytes of one micro-batch, bytes received, bytes sent) of each of `stages`."""
    from isotrain.memory.fake_forward import fake_stage_forward
    from isotrain.models.checks import attention_kernel
    from transformers import AutoModelForCausalLM

    _, compute = DTYPES[dtype]
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModelForCausalLM)
    return {stage: fake_stage_forward(config, kernel, stage=stage, pp=degrees.pp_stages, device=device,
                                      micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.max_seq_len,
                                      autocast_dtype=compute if compute != torch.float32 else None,
                                      activation_checkpointing=checkpointing)
            for stage in stages}


def _logits_bytes(saved) -> int:
    upcast = saved.logits_numel * FP32_BYTES if saved.logits_dtype not in (None, torch.float32) else 0
    return saved.by_kind["logits_loss"] + saved.logits_bytes + upcast


def stage_terms(cfg, config, degrees: ParallelDims, dtype: str, device: str, rank: int,
                num_microbatches: int) -> list[Term]:
    """Every term of the ranks at pipeline position `rank`: stage `rank`, or under interleaved 1F1B its
    pp_stages_per_rank stages rank, rank + pp, ..."""
    from isotrain.parallel.pp import apply_pp, rank_stages, stage_layers

    pp, per_rank, m = degrees.pp, degrees.pp_stages_per_rank, num_microbatches
    stages = rank_stages(rank, pp, per_rank)
    last_stage = degrees.pp_stages - 1
    model = meta_model(cfg, config)
    apply_pp(model, rank, pp, per_rank)
    checkpointing = cfg.train.activation_checkpointing == "full"
    forwards = _stage_forwards(cfg, config, degrees, dtype, device, stages, checkpointing)
    activations = peak_in_flight(degrees, rank, m, {s: f[0].by_kind["activations"] for s, f in forwards.items()})
    logits = peak_in_flight(degrees, rank, m, {s: _logits_bytes(f[0]) if s == last_stage else 0
                                               for s, f in forwards.items()})
    kept = peak_in_flight(degrees, rank, m, {s: f[2] for s, f in forwards.items()})
    buffers = sum(m * (received + sent) for _, received, sent in forwards.values()) + kept
    recomputed = []
    if checkpointing:
        full = _stage_forwards(cfg, config, degrees, dtype, device, stages, False)
        body = lambda s: s.by_kind["activations"] + s.by_kind["compute_copies"]  # noqa: E731
        layer = max((body(full[s][0]) - body(forwards[s][0])) // len(stage_layers(config.num_hidden_layers,
                                                                                   degrees.pp_stages, s))
                    for s in stages)
        recomputed = [Term("recomputed layer", max(0, layer), "one decoder layer's activations, rebuilt in backward")]
    if per_rank == 1:
        flight = microbatches_in_flight(degrees.pp_schedule, rank, pp, m)
        schedule = f"{degrees.pp_schedule}: {flight} of {m} micro-batches in flight on stage {rank} of {pp}"
    else:
        schedule = (f"interleaved_1f1b: stages {', '.join(map(str, stages))} of {degrees.pp_stages}, the most held "
                    f"at once in torch's order of their {m} micro-batches each")
    tokens = f"{cfg.train.micro_batch_size} × {cfg.data.max_seq_len} tokens"
    holds_last = last_stage in stages
    return [*model_state_terms(model, config, degrees, dtype),
            Term("activations", activations, f"saved for backward, {tokens} per micro-batch ({schedule})"
                 + (", layer inputs only (checkpointing)" if checkpointing else "")),
            Term("compute copies", sum(f[0].by_kind["compute_copies"] for f in forwards.values()),
                 "autocast's low-precision weight copies, made once per step (one autocast region)"),
            Term("logits and loss", logits, "head/loss saved tensors + logits of the micro-batches in flight"
                 if holds_last else "none: the last stage computes them"),
            Term("pipeline buffers", buffers,
                 f"receive buffers of {m} micro-batches per stage (hidden states after the first stage, their "
                 "gradients before the last) + the hidden states sent on, kept while in flight; one schedule's "
                 "(parallel/pp.py keeps up to 2 shapes')" if buffers else "none"),
            *recomputed]
