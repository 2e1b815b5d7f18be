"""The per-stage terms (memory/pipeline.py) measured on a live pipeline rank, through a real step's schedule.

The schedule decides when each micro-batch's forward and backward run, so the measurement follows it instead of
assuming it: what each micro-batch's forward (and the last stage's loss after it) saves for backward is counted
apart (memory/saved.py, split by micro-batch), and at every forward and backward the schedule starts, the storages
of the micro-batches whose backward has not run yet are added up (each storage once: autocast's weight copies are
shared by every micro-batch of a step). The peak of each kind over the step is its term. The pipeline's buffers
are read off torch's stages: the receive buffers of every micro-batch, and at each of those moments the stage
outputs kept for backward (a stage before the last: the hidden states it sent on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

import isotrain.train.chunked_loss as chunked_loss
from isotrain.moe.objective import RouterStep

from isotrain.memory.measure import (fsdp_buffers, fsdp_groups, gradient_bytes, optimizer_bytes, parameter_bytes,
                                     storage_bytes)
from isotrain.memory.saved import SavedBytes, chunks_kept, count_saved


def _in_flight_bytes(per_microbatch: dict[tuple[int, int], SavedBytes]) -> dict[str, int]:
    """Bytes by kind of the distinct storages the micro-batches in flight saved, and their logits."""
    by_kind: dict[str, int] = {}
    seen = set()
    for saved in per_microbatch.values():
        for key, storage in saved.storages.items():
            if key in seen or key not in saved.kinds:
                continue
            seen.add(key)
            by_kind[saved.kinds[key]] = by_kind.get(saved.kinds[key], 0) + storage.nbytes()
    upcast = sum(s.upcast_bytes for s in per_microbatch.values())
    by_kind["logits"] = sum(s.logits_bytes for s in per_microbatch.values()) + upcast
    return by_kind


def _receive_buffers(stages) -> int:
    infos = [info for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)
             for infos in table.values() for info in infos]
    return storage_bytes(getattr(info, "buffer", None) for info in infos)


def _kept_outputs(stages) -> int:
    """The stage outputs a stage before the last keeps until each micro-batch's backward (torch's fwd_cache; under a
    zero-bubble schedule, its backward_state from the input backward until the weight backward), and those a
    forward-only schedule's stages keep until its next step (an MoE model's routing pre-pass: the last stage's
    are empty, it forms no logits)."""
    outputs = [output for stage in stages if not stage.is_last or not stage.has_backward
               for output, _ in stage.fwd_cache.values()]
    outputs += [state[2] for stage in stages if not stage.is_last
                for state in getattr(stage, "backward_state", {}).values()]
    return storage_bytes(t for output in outputs for t in (output if isinstance(output, (tuple, list)) else (output,))
                         if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def pipeline_saved(model: nn.Module) -> Iterator[dict]:
    """Peak bytes, by kind, that the micro-batches in flight on this stage hold for backward during the steps run
    inside ("activations", "compute_copies", "logits_loss", "logits"), and of the pipeline's buffers ("buffers")."""
    from torch.distributed.pipelining import PipelineStage

    from isotrain.parallel.apply import decoder_layers
    from isotrain.parallel.pp import PassThrough

    peak: dict[str, int] = {"buffers": 0}
    per_microbatch: dict[tuple[int, int], SavedBytes] = {}  # (stage, micro-batch) in flight
    current: dict = {"saved": None}
    stages = set()
    handles: dict = {}  # stage view -> its hooks (`_past_hand_off`), removed at the end
    forward, backward = PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk
    weight_backward = PipelineStage.backward_weight_one_chunk

    def sample() -> None:
        for kind, value in _in_flight_bytes(per_microbatch).items():
            peak[kind] = max(peak.get(kind, 0), value)
        peak["buffers"] = max(peak["buffers"], _receive_buffers(stages) + _kept_outputs(stages))

    def forward_one_chunk(stage, chunk: int, *args, **kwargs):
        sample()  # the previous micro-batch's forward, and the last stage's loss after it, are done
        stages.add(stage)
        if not torch.is_grad_enabled():  # the routing pre-pass: it saves nothing for a backward (its buffers count)
            current["saved"] = None
            return forward(stage, chunk, *args, **kwargs)
        saved = per_microbatch[(stage.stage_index, chunk)] = SavedBytes()
        _past_hand_off(stage.submod, model, current, handles)
        if not stage.is_first:  # the received hidden states are a receive buffer, counted as one
            for info in stage.args_recv_info[chunk]:
                if getattr(info, "buffer", None) is not None:
                    saved.skip(info.buffer)
        current["saved"] = saved
        return forward(stage, chunk, *args, **kwargs)

    def backward_one_chunk(stage, chunk: int, *args, full_backward: bool = True, **kwargs):
        sample()
        current["saved"] = None  # (a recompute in backward saves nothing for this count)
        result = backward(stage, chunk, *args, full_backward=full_backward, **kwargs)
        if full_backward:  # (a zero-bubble input backward keeps the graph for the weight backward)
            per_microbatch.pop((stage.stage_index, chunk), None)
        return result

    def backward_weight_one_chunk(stage, chunk: int, *args, **kwargs):
        sample()
        current["saved"] = None
        result = weight_backward(stage, chunk, *args, **kwargs)
        per_microbatch.pop((stage.stage_index, chunk), None)
        return result

    own = [layer for layer in decoder_layers(model) if not isinstance(layer, PassThrough)]
    loss_sum, router_term = chunked_loss.chunked_loss_sum, RouterStep.term

    def term(step, *args, **kwargs):  # an MoE stage's router terms (train/pipeline_step.py router_fn)
        saved = current["saved"]
        if saved is not None:
            saved.in_router = True
        try:
            return router_term(step, *args, **kwargs)
        finally:
            if saved is not None:
                saved.in_router = False

    PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    PipelineStage.backward_weight_one_chunk = backward_weight_one_chunk
    chunked_loss.chunked_loss_sum = _counted_chunks(loss_sum, current, peak)
    RouterStep.term = term
    try:
        with count_saved(model, own, target=lambda: current["saved"]):
            yield peak
        sample()
    finally:
        PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = forward, backward
        PipelineStage.backward_weight_one_chunk = weight_backward
        chunked_loss.chunked_loss_sum, RouterStep.term = loss_sum, router_term
        for handle in (h for pair in handles.values() for h in pair):
            handle.remove()


def _past_hand_off(stage_module: nn.Module, model: nn.Module, current: dict, handles: dict) -> None:
    """A stage view of a rank of several stages (parallel/pp_stages.py) before the last: what its model saves after its
    HandOff (transformers' own aux loss of an MoE model's router logits, dropped with the model's output) is not
    held, as the rank's own model's head, hooked by count_saved, leaves it out of a stage's terms: counting stops
    from the HandOff to the end of the view's forward (the stage's router terms, formed after it, count)."""
    from isotrain.parallel.pp_stages import HandOff

    view = getattr(stage_module, "model", None)
    if view is None or view is model or view in handles:
        return
    head = view.get_output_embeddings()
    if not isinstance(head, HandOff):
        return
    paused = {}

    def stop(mod, args):
        paused["saved"], current["saved"] = current["saved"], None

    def resume(mod, args, out):
        if "saved" in paused:
            current["saved"] = paused.pop("saved")

    handles[view] = (head.register_forward_pre_hook(stop), view.register_forward_hook(resume))


def measure_pipeline_terms(model: nn.Module, optimizer: torch.optim.Optimizer, options, steps: tuple[list, list],
                           device: torch.device) -> dict[str, int]:
    """Every per-stage term, by name, on this live pipeline rank: one real `train_step` on the micro-batches of
    `steps[0]` (gradients between backward and update, optimizer state after it; its schedule is built then), then
    the in-flight peaks during a second step on `steps[1]`, which reuses that schedule."""
    from isotrain.models.unwrap import hf_model
    from isotrain.parallel.pp import last_stage_rank
    from isotrain.train.step import train_step

    measured = {"parameters": parameter_bytes(model)}
    train_step(model, optimizer, steps[0], 1e-3, options, device,
               before_update=lambda: measured.update(gradients=gradient_bytes(model)))
    measured["optimizer moments"] = optimizer_bytes(optimizer)
    with pipeline_saved(hf_model(model)) as peak, fsdp_buffers(hf_model(model)) as buffers:
        train_step(model, optimizer, steps[1], 1e-3, options, device)
    if fsdp_groups(hf_model(model)):
        measured["FSDP2 all-gather buffers"] = buffers["gathered"]
        measured["FSDP2 reduce-scatter buffers"] = buffers["reduce"]
    measured["activations"] = peak.get("activations", 0)
    measured["compute copies"] = peak.get("compute_copies", 0)
    # (an earlier stage's HandOff is its "head": what it hands on is counted with the buffers, not as logits)
    dims = options.parallel.dims
    last = options.parallel.pp_rank == last_stage_rank(dims.pp, dims.pp_schedule)
    measured["logits and loss"] = (peak.get("logits_loss", 0) + peak.get("logits", 0) + peak.get("chunk", 0)
                                   if last else 0)
    measured["pipeline buffers"] = peak["buffers"]
    if options.router is not None:
        measured["router logits and terms"] = peak.get("router", 0)
    return measured


def _counted_chunks(loss_sum, current: dict, peak: dict):
    """The last stage's chunked loss (train.loss_chunk_tokens, train/chunked_loss.py) as the step runs it, counted as
    the measurement without a pipeline counts it (memory/saved.py `chunked_loss_fn`): the trained tokens' final
    hidden states, labels and weights, which the chunks' checkpoints keep until the micro-batch's backward, are the
    micro-batch's "logits_loss"; one more forward of a first chunk on them outside checkpointing, left out of the
    loss, gives what a chunk's head and loss hold while backward recomputes it (one chunk at a time: its peak is
    "chunk", held once). The chunks' logits that the head noted are freed by their checkpoints: not the
    micro-batch's."""
    from isotrain.train.chunked_loss import chunk_loss_sum

    def counted(head, hidden, labels, weights, chunk_tokens, trained=None, compiled=False):
        loss, kept = chunks_kept(loss_sum, head, hidden, labels, weights, chunk_tokens, trained, compiled)
        saved = current["saved"]
        if saved is None or trained is None:
            return loss
        saved.logits_bytes, saved.logits_numel, saved.logits_dtype = 0, 0, None
        saved.add(kept, "logits_loss")
        chunk = current["saved"] = SavedBytes(in_head=True)
        chunk_labels, chunk_weights = labels.reshape(-1)[trained], weights.reshape(-1)[trained]
        for held in (kept, chunk_labels, chunk_weights):  # the micro-batch's (its chunks' stand-ins)
            chunk.skip(held)
        try:
            first = slice(0, chunk_tokens)
            chunk_loss_sum(head, kept[first], chunk_labels[first], chunk_weights[first])
        finally:
            current["saved"] = saved
        peak["chunk"] = max(peak.get("chunk", 0), chunk.by_kind["logits_loss"] + chunk.logits_bytes + chunk.upcast_bytes)
        return loss

    return counted
