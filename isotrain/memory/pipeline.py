"""Per-stage memory of a pipeline-parallel run (parallel.pp, parallel/pp.py): every stage's own terms.

Model states: the model built on meta and reduced to the stage by the run's own `apply_pp` (its decoder layers; the
input embedding on the first stage, the final norm and the head on the last, a tied embedding on both), counted as
for any rank (estimate.py `model_state_terms`): split by TP's plan and FSDP2's padded dim-0 shards over the stage's
dp_shard ranks, as without a pipeline. FSDP2's buffers are `fsdp_terms` of the stage's model: under 1F1B and GPipe
the HF model is the stage's root (its embedding, or its final norm and head) over one group per layer, as without
a pipeline, and each micro-batch's forward and backward gathers, frees and reduces them as one process's step does
(the root's reduce at the end of each backward: its inputs, token ids or the received hidden states, reach it
last), so the peaks are those of one micro-batch. Interleaved 1F1B beside FSDP2, whose stage roots keep their
parameters and gradients gathered through the step (parallel/apply.py `shard_stages`), is refused.

Under TP a stage's forward is one TP rank's (fake_forward.py `tp_rank_config`: its heads, MLP width and vocabulary
slice, the logits sharded over the vocabulary); the hidden states between stages are whole on every TP rank. Under
FSDP2 the stage computes in FSDP2's parameter dtype (no autocast copies), and sends its hidden states in it.

Activations: one micro-batch's forward of the stage on fake tensors (fake_forward.py `fake_stage_forward`), times the
micro-batches whose backward has not run yet at the schedule's worst moment (`microbatches_in_flight`), with m the
batch plan's gradient-accumulation micro-batches (the pipeline's, isotrain/sizes.py):

    1f1b   stage s of p: min(p - s, m)   (torch's Schedule1F1B warms up with that many forwards, then
                                          alternates one backward and one forward)
    gpipe  m                             (every forward before the first backward)
    interleaved_1f1b, interleaved_zb,    rank r holds several stages (r, r + p, ...; zbv and dualpipev: r and
    zbv, dualpipev                        2p - 1 - r): the most bytes its stages' micro-batches hold at once in
                                          torch's own order of r's forwards and backwards (`schedule_order`), the
                                          stages' sizes differing (embedding, head, parallel.pp_split). A zero-bubble
                                          schedule splits a backward into input (I) and weight (W) halves: the
                                          activations stay held until W (torch keeps the graph for it); the output
                                          gradients each weight waits for between I and W are not counted. A
                                          micro-batch's own inputs that its stages save (position ids, an MoE
                                          model's router mask) are one tensor for all the rank's stages: counted
                                          once while any of them holds the micro-batch (`stage_inputs`)

The logits (and the loss's saved tensors) of a micro-batch exist on the last stage only, once per micro-batch in
flight (the schedule keeps each stage output until its backward). With the chunked loss (train.loss_chunk_tokens)
the last stage's forward computes the micro-batch's loss in chunks: each micro-batch in flight keeps its trained
tokens' final hidden states (labels, weights) for its chunks' checkpoints, and backward recomputes one chunk at a
time, so one chunk's head/loss tensors and logits are held once (`_logits_bytes`). Autocast's low-precision weight copies are made
once per step (the schedule runs in one autocast region, which caches them), not once per micro-batch.

Mixture-of-experts models (under every schedule): each stage's experts split over its EP group
(whole experts, out of FSDP2), its forward routed as without a pipeline (transformers' grouped_mm, or EP's
dispatch under balanced routing), its router terms per micro-batch in flight (`router logits and terms`). EP casts
its local experts to the compute dtype in every micro-batch's forward (not autocast's cached copies): those copies
count per micro-batch in flight (`_expert_copies`). The routing pre-pass (moe/prepass.py) runs a forward-only
schedule of its own, whose stages hold their receive buffers and keep each micro-batch's output until its next step:
the pipeline buffers twice (its last stage forms no logits: parallel/pp.py `Pipeline.forward_only`).

Pipeline buffers (torch.distributed.pipelining's stage): a receive buffer per micro-batch for the hidden states
(every stage after the first) and for their gradients (every stage before the last), allocated when the schedule
is built and kept with it (parallel/pp.py `Pipeline` keeps the schedules of its last KEPT shapes); and the hidden
states a stage before the last sent on, kept until the micro-batch's backward.
"""

from __future__ import annotations

import torch

from isotrain.errors import ConfigError
from isotrain.memory.fsdp_buffers import fsdp_terms
from isotrain.memory.terms import DTYPES, Term, meta_model, model_state_terms
from isotrain.parallel.dims import ParallelDims


def microbatches_in_flight(schedule: str, stage: int, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at most, on `stage` of a schedule with one
    stage per rank (see the docstring)."""
    if schedule == "gpipe":
        return num_microbatches
    return min(pp - stage, num_microbatches)


def schedule_order(schedule: str, rank: int, pp: int, per_rank: int,
                   num_microbatches: int) -> list[tuple[str, int, int]]:
    """The forwards ("F"), backwards ("B") and a zero-bubble schedule's input ("I") and weight ("W") backwards of
    (stage, micro-batch) that torch's schedule of several stages per rank runs on `rank`, in order: its own
    computation of the order (`_calculate_single_rank_operations`, which reads nothing but these sizes), as every
    rank of a real run computes it; an overlapped forward-backward (DualPipeV) as its forward, then its backward."""
    from types import SimpleNamespace

    import torch.distributed.pipelining.schedules as schedules

    from isotrain.parallel.pp import SCHEDULE_CLASSES

    rounds = max(1, num_microbatches // pp)
    sizes = SimpleNamespace(n_local_stages=per_rank, pp_group_size=pp, _n_microbatches=num_microbatches,
                            number_of_rounds=rounds, microbatches_per_round=num_microbatches // rounds,
                            num_stages=pp * per_rank)
    actions = getattr(schedules, SCHEDULE_CLASSES[schedule])._calculate_single_rank_operations(sizes, rank)
    kinds = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.FULL_BACKWARD: "B",
             schedules._ComputationType.BACKWARD_INPUT: "I", schedules._ComputationType.BACKWARD_WEIGHT: "W"}
    flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in flat]


def peak_in_flight(degrees: ParallelDims, rank: int, num_microbatches: int, bytes_of: dict[int, int],
                   shared_of: dict[int, int] | None = None) -> int:
    """The most bytes that the micro-batches in flight on `rank` hold at once, when one micro-batch of stage s
    holds `bytes_of[s]`, `shared_of[s]` of them the micro-batch's own inputs (its position ids, its router mask), one
    tensor for all the rank's stages: 1F1B and GPipe by their counts; the schedules of several stages per rank by
    walking torch's order (a micro-batch's bytes are freed by its full or its weight backward), each micro-batch's
    inputs counted once while any of its stages holds them."""
    if degrees.pp_stages_per_rank == 1:
        return microbatches_in_flight(degrees.pp_schedule, rank, degrees.pp, num_microbatches) * bytes_of[rank]
    shared_of = shared_of or {}
    flight: set[tuple[int, int]] = set()
    peak = 0
    for kind, stage, micro_batch in schedule_order(degrees.pp_schedule, rank, degrees.pp,
                                                   degrees.pp_stages_per_rank, num_microbatches):
        if kind == "F":
            flight.add((stage, micro_batch))
        elif kind != "I":
            flight.discard((stage, micro_batch))
        inputs: dict[int, list[int]] = {}
        for s, i in flight:
            inputs.setdefault(i, []).append(shared_of.get(s, 0))
        held = sum(bytes_of[s] for s, _ in flight) - sum(sum(shared) - max(shared) for shared in inputs.values())
        peak = max(peak, held)
    return peak


def check_pipeline_estimate(cfg, degrees: ParallelDims) -> None:
    """The pipelines estimated: every schedule beside DDP, FSDP2 (not interleaved) and TP, for SFT, with or without
    the chunked loss, dense or mixture-of-experts models, with or without expert parallelism."""
    from isotrain.config import RLRunConfig

    if degrees.fsdp and degrees.pp_stages_per_rank > 1:
        raise ConfigError(f"isotrain estimate-memory does not estimate parallel.pp_schedule=interleaved_1f1b beside "
                          f"FSDP2 (parallel.dp_shard={degrees.dp_shard}) yet, whose stages keep their parameters and "
                          "gradients gathered through the step; estimate it with parallel.pp_schedule=1f1b, or with "
                          "parallel.dp_shard=1")
    if isinstance(cfg, RLRunConfig):
        raise ConfigError(f"isotrain estimate-memory estimates pipeline stages (parallel.pp={degrees.pp}) of SFT runs "
                          "only; estimate the RL run with parallel.pp=1")


def _stage_forwards(cfg, config, degrees: ParallelDims, dtype: str, device: str, stages: list[int],
                    checkpointing: bool) -> dict:
    """stage -> (SavedBytes of one micro-batch, bytes received, bytes sent) of each of `stages`."""
    from isotrain.memory.fake_forward import fake_stage_forward
    from isotrain.models.checks import attention_kernel
    from isotrain.moe.settings import router_settings
    from transformers import AutoModelForCausalLM

    _, compute = DTYPES[dtype]
    lowp = compute != torch.float32
    kernel = attention_kernel(cfg.model.attn_implementation, config, AutoModelForCausalLM)
    # FSDP2 casts the parameters to the compute dtype itself; DDP and TP runs use autocast (estimate.py's rule).
    return {stage: fake_stage_forward(config, kernel, stage=stage, pp=degrees.pp_stages, split=degrees.pp_split,
                                      device=device,
                                      micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.max_seq_len,
                                      autocast_dtype=compute if lowp and not degrees.fsdp else None,
                                      param_dtype=compute if degrees.fsdp else torch.float32, tp=degrees.tp,
                                      fsdp=degrees.fsdp, chunk_tokens=cfg.train.loss_chunk_tokens, ep=degrees.ep,
                                      router=router_settings(cfg.moe, config),
                                      activation_checkpointing=checkpointing)
            for stage in stages}


def _logits_bytes(saved) -> tuple[int, int]:
    """(bytes each micro-batch in flight holds, bytes held once) of the head and the loss. With the chunked loss,
    a micro-batch keeps its final hidden states until its backward, which recomputes one chunk's head and loss at a
    time: the chunk's tensors and logits are held once, whatever the micro-batches in flight."""
    upcast = saved.upcast_bytes
    total = saved.by_kind["logits_loss"] + saved.logits_bytes + upcast
    once = saved.chunk_bytes + saved.logits_bytes + upcast if saved.chunk_bytes else 0
    return total - once, once


def _expert_copies(model, config, degrees: ParallelDims, dtype: str, stages: list[int]) -> dict[int, int]:
    """stage -> bytes of its local experts' compute-dtype copies, which expert parallelism makes in every micro-batch's
    forward (parallel/ep.py: a cast of the weights, not autocast's, so not cached for the step); 0 without EP or in
    fp32."""
    from isotrain.memory.shards import expert_parameter_names
    from isotrain.parallel.pp import stage_layers

    _, compute = DTYPES[dtype]
    if degrees.ep == 1 or compute == torch.float32:
        return dict.fromkeys(stages, 0)
    names = expert_parameter_names(model)
    shapes = {name: p.numel() // degrees.ep for name, p in model.named_parameters() if name in names}
    prefix = lambda layer: f".layers.{layer}."  # noqa: E731
    return {s: sum(n for name, n in shapes.items()
                   if any(prefix(layer) in f".{name}" for layer in stage_layers(config.num_hidden_layers,
                                                                                 degrees.pp_stages, s,
                                                                                 degrees.pp_split)))
               * compute.itemsize for s in stages}


def _router_terms(cfg, config, degrees: ParallelDims, rank: int, num_microbatches: int,
                  forwards: dict) -> tuple[list[Term], bool]:
    """An MoE model's router term of pipeline rank `rank` (its stages' router logits and terms, per micro-batch in
    flight), and whether the step runs the routing pre-pass (moe/prepass.py): a forward-only schedule of its own,
    whose stages hold receive buffers of the hidden states for each micro-batch and keep each micro-batch's output
    (torch's fwd_cache, cleared at that schedule's next step), as many bytes again as the training schedule's
    receive buffers and sends."""
    from isotrain.moe.prepass import runs_pipeline_prepass
    from isotrain.moe.settings import router_settings

    settings = router_settings(cfg.moe, config)
    if settings is None:
        return [], False
    held = peak_in_flight(degrees, rank, num_microbatches, {s: f[0].by_kind["router"] for s, f in forwards.items()},
                          {s: f[0].stage_inputs.get("router", 0) for s, f in forwards.items()})
    note = ("the stage's router logits kept for its aux / z-loss terms, their fp32 probabilities, of the micro-batches "
            "in flight" + ("; EP: balanced routing (each rank receives as many rows as it sends)" if degrees.ep > 1
                           else ""))
    return [Term("router logits and terms", held, note)], runs_pipeline_prepass(settings)


def stage_terms(cfg, config, degrees: ParallelDims, dtype: str, device: str, rank: int,
                num_microbatches: int) -> list[Term]:
    """Every term of the ranks at pipeline position `rank`: stage `rank`, or under a schedule of several stages per
    rank its pp_stages_per_rank stages (parallel/pp.py `rank_stages`), each with its parallel.pp_split layers."""
    from isotrain.parallel.pp import apply_pp, rank_stages, stage_layers

    pp, per_rank, m = degrees.pp, degrees.pp_stages_per_rank, num_microbatches
    stages = rank_stages(rank, pp, per_rank, degrees.pp_schedule)
    last_stage = degrees.pp_stages - 1
    model = meta_model(cfg, config)
    apply_pp(model, rank, pp, per_rank, degrees.pp_split, degrees.pp_schedule)
    checkpointing = cfg.train.activation_checkpointing == "full"
    forwards = _stage_forwards(cfg, config, degrees, dtype, device, stages, checkpointing)
    activations = peak_in_flight(degrees, rank, m, {s: f[0].by_kind["activations"] for s, f in forwards.items()},
                                 {s: f[0].stage_inputs.get("activations", 0) for s, f in forwards.items()})
    head = {s: _logits_bytes(f[0]) if s == last_stage else (0, 0) for s, f in forwards.items()}
    logits = peak_in_flight(degrees, rank, m, {s: b[0] for s, b in head.items()}) + sum(b[1] for b in head.values())
    kept = peak_in_flight(degrees, rank, m, {s: f[2] for s, f in forwards.items()})
    router, prepass = _router_terms(cfg, config, degrees, rank, m, forwards)
    experts = _expert_copies(model, config, degrees, dtype, stages)
    copies = (sum(f[0].by_kind["compute_copies"] - experts[s] for s, f in forwards.items())
              + peak_in_flight(degrees, rank, m, experts))
    buffers = sum(m * (received + sent) for _, received, sent in forwards.values()) * (2 if prepass else 1) + kept
    recomputed = []
    if checkpointing:
        full = _stage_forwards(cfg, config, degrees, dtype, device, stages, False)
        body = lambda s: s.by_kind["activations"] + s.by_kind["compute_copies"]  # noqa: E731
        layer = max((body(full[s][0]) - body(forwards[s][0])) // len(stage_layers(config.num_hidden_layers,
                                                                                   degrees.pp_stages, s,
                                                                                   degrees.pp_split))
                    for s in stages)
        recomputed = [Term("recomputed layer", max(0, layer), "one decoder layer's activations, rebuilt in backward")]
    if per_rank == 1:
        flight = microbatches_in_flight(degrees.pp_schedule, rank, pp, m)
        schedule = f"{degrees.pp_schedule}: {flight} of {m} micro-batches in flight on stage {rank} of {pp}"
    else:
        schedule = (f"{degrees.pp_schedule}: stages {', '.join(map(str, stages))} of {degrees.pp_stages}, the most "
                    f"held at once in torch's order of their {m} micro-batches each")
    tokens = f"{cfg.train.micro_batch_size} × {cfg.data.max_seq_len} tokens"
    holds_last, chunk = last_stage in stages, cfg.train.loss_chunk_tokens
    return [*model_state_terms(model, config, degrees, dtype), *fsdp_terms(model, config, degrees, dtype),
            Term("activations", activations, f"saved for backward, {tokens} per micro-batch ({schedule})"
                 + (", layer inputs only (checkpointing)" if checkpointing else "")),
            Term("compute copies", copies, "autocast's low-precision weight copies, made once per step (one "
                 "autocast region)" + ("; EP: the local experts cast to the compute dtype by each micro-batch's "
                                        "forward, of the micro-batches in flight" if any(experts.values()) else "")),
            Term("logits and loss", logits, ((f"chunked ({chunk} tokens): the final hidden states of the micro-batches "
                                              "in flight + one chunk's head/loss tensors and logits, as backward "
                                              "recomputes it") if chunk else
                                             "head/loss saved tensors + logits of the micro-batches in flight")
                 if holds_last else "none: the last stage computes them"),
            Term("pipeline buffers", buffers,
                 f"receive buffers of {m} micro-batches per stage (hidden states after the first stage, their "
                 "gradients before the last) + the hidden states sent on, kept while in flight; one schedule's "
                 "(parallel/pp.py keeps up to 2 shapes')"
                 + ("; twice: the MoE routing pre-pass's forward-only schedule too" if prepass else "")
                 if buffers else "none"),
            *router, *recomputed]
