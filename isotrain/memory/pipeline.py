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
from isotrain.memory.estimate import DTYPES, FP32_BYTES, Term, meta_model, model_state_terms
from isotrain.parallel.dims import ParallelDims


def microbatches_in_flight(schedule: str, stage: int, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at most, on `stage` (see the docstring)."""
    if schedule == "gpipe":
        return num_microbatches
    return min(pp - stage, num_microbatches)


def check_pipeline_estimate(cfg, degrees: ParallelDims) -> None:
    """The pipelines estimated: one stage per rank (1f1b, gpipe), beside DDP replicas, for SFT."""
    from isotrain.config import RLRunConfig

    if degrees.pp_schedule == "interleaved_1f1b":
        raise ConfigError("isotrain estimate-memory does not estimate parallel.pp_schedule=interleaved_1f1b yet (its "
                          "micro-batches in flight per stage); estimate parallel.pp_schedule=1f1b or gpipe instead")
    if degrees.fsdp or degrees.tp > 1:
        named = f"parallel.dp_shard={degrees.dp_shard}" if degrees.fsdp else f"parallel.tp={degrees.tp}"
        raise ConfigError(f"isotrain estimate-memory estimates pipeline stages beside DDP replicas only, not {named} "
                          f"(parallel.pp={degrees.pp}); estimate the stage's layout with parallel.pp=1, or the "
                          "pipeline with parallel.dp_shard=1 and parallel.tp=1")
    if isinstance(cfg, RLRunConfig):
        raise ConfigError(f"isotrain estimate-memory estimates pipeline stages (parallel.pp={degrees.pp}) of SFT runs "
                          "only; estimate the RL run with parallel.pp=1")


def stage_terms(cfg, config, degrees: ParallelDims, dtype: str, device: str, stage: int,
                num_microbatches: int) -> list[Term]:
    """Every term of the ranks that hold pipeline stage `stage`."""
    from isotrain.memory.fake_forward import fake_stage_forward
    from isotrain.models.checks import attention_kernel
    from isotrain.parallel.pp import apply_pp, stage_layers
    from transformers import AutoModelForCausalLM

    pp, last = degrees.pp, stage == degrees.pp - 1
    model = meta_model(cfg, config)
    apply_pp(model, stage, pp)
    _, compute = DTYPES[dtype]
    checkpointing = cfg.train.activation_checkpointing == "full"
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModelForCausalLM)
    saved, received, sent = fake_stage_forward(
        config, kernel, stage=stage, pp=pp, micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.max_seq_len,
        autocast_dtype=compute if compute != torch.float32 else None, activation_checkpointing=checkpointing,
        device=device)
    flight = microbatches_in_flight(degrees.pp_schedule, stage, pp, num_microbatches)
    upcast = saved.logits_numel * FP32_BYTES if saved.logits_dtype not in (None, torch.float32) else 0
    logits = saved.by_kind["logits_loss"] + saved.logits_bytes + upcast
    m = num_microbatches
    buffers = m * received + (m + flight) * sent
    recomputed = []
    if checkpointing:
        full, _, _ = fake_stage_forward(
            config, kernel, stage=stage, pp=pp, micro_batch_size=cfg.train.micro_batch_size,
            seq_len=cfg.data.max_seq_len, autocast_dtype=compute if compute != torch.float32 else None,
            activation_checkpointing=False, device=device)
        body = lambda s: s.by_kind["activations"] + s.by_kind["compute_copies"]  # noqa: E731
        own = len(stage_layers(config.num_hidden_layers, pp, stage))
        recomputed = [Term("recomputed layer", max(0, body(full) - body(saved)) // own,
                           "one decoder layer's activations, rebuilt in backward")]
    schedule = f"{degrees.pp_schedule}: {flight} of {m} micro-batches in flight on stage {stage} of {pp}"
    tokens = f"{cfg.train.micro_batch_size} × {cfg.data.max_seq_len} tokens"
    return [*model_state_terms(model, config, degrees, dtype),
            Term("activations", flight * saved.by_kind["activations"],
                 f"saved for backward, {tokens} per micro-batch × {flight} ({schedule})"
                 + (", layer inputs only (checkpointing)" if checkpointing else "")),
            Term("compute copies", saved.by_kind["compute_copies"],
                 "autocast's low-precision weight copies, made once per step (one autocast region)"),
            Term("logits and loss", flight * logits if last else 0,
                 f"head/loss saved tensors + logits, × {flight} micro-batches in flight" if last
                 else "none: the last stage computes them"),
            Term("pipeline buffers", buffers,
                 f"receive buffers of {m} micro-batches ({'hidden states' if stage else ''}"
                 f"{' and ' if stage and not last else ''}{'their gradients' if not last else ''}) + the hidden "
                 f"states sent on, kept for {flight} in flight; one schedule's (parallel/pp.py keeps up to "
                 "2 shapes')" if buffers else "none"),
            *recomputed]
