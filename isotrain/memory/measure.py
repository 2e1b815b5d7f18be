"""The estimate's terms measured on a live rank: bytes of the real tensors, one storage counted once.

Model states are read from the tensors themselves (a DTensor's local shard, FSDP2's padded shard storage);
activations with the same saved-tensor counter the estimate uses (memory/saved.py), around a real forward
of the SFT step's loss; FSDP2's unsharded buffers by sampling its parameter groups during a real forward and
backward (`fsdp_buffers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from isotrain.memory.saved import local_tensor, count_saved, forward_loss
from isotrain.parallel.apply import decoder_layers


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local part)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def parameter_bytes(model: nn.Module) -> int:
    return storage_bytes(p for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))


class _Tracked:
    """A point-to-point work whose wait tells `exchange_buffers` that its buffers are no longer in flight."""

    def __init__(self, work, pending: dict, key: int):
        self.work, self.pending, self.key = work, pending, key

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self.pending.pop(self.key, None)
        return result


@contextlib.contextmanager
def exchange_buffers() -> Iterator[dict]:
    """Peak bytes of context parallelism's exchange buffers on this rank ("bytes"): the send and receive buffers of
    each all-to-all (Ulysses), and the buffers of every point-to-point batch not yet waited for (ring attention's
    blocks and their gradients in flight), sampled at each collective's start."""
    import torch.distributed as dist

    peak, pending = {"bytes": 0}, {}
    all_to_all, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def all_to_all_single(output, input, *args, **kwargs):
        peak["bytes"] = max(peak["bytes"], storage_bytes([output, input]))
        return all_to_all(output, input, *args, **kwargs)

    def batch_isend_irecv(ops):
        works = batch(ops)
        key = id(ops)
        pending[key] = [op.tensor for op in ops]
        peak["bytes"] = max(peak["bytes"], storage_bytes(t for tensors in pending.values() for t in tensors))
        return [_Tracked(work, pending, key) for work in works]

    dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
    try:
        yield peak
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all, batch


def _context_parallel(micro_batch: dict, weights: torch.Tensor, parallel):
    """This CP rank's piece of `micro_batch` and `weights` and the context its forward and backward run in, as the
    SFT step cuts and runs them (train/step.py); the micro-batch itself without CP."""
    from isotrain.parallel.cp import context_parallel_attention, local_piece, pad_rows, padded_length

    if parallel is None or parallel.dims.cp == 1:
        return micro_batch, weights, contextlib.nullcontext()
    dims = parallel.dims
    piece, weights = local_piece(micro_batch, parallel.cp_rank, dims.cp, weights, dims.cp_style)
    positions = micro_batch["position_ids"]
    positions = pad_rows(positions, padded_length(positions.shape[1], dims.cp, dims.cp_style), None)
    return piece, weights, context_parallel_attention(parallel.cp_group, positions, dims.cp_style)


def activation_bytes(model: nn.Module, micro_batch: dict, autocast_dtype, loss_parallel: bool,
                     router=None, chunk_tokens: int = 0, parallel=None) -> dict[str, int]:
    """What a real forward of `micro_batch` keeps for backward, by kind, plus the logits (memory/saved.py); under
    context parallelism (`parallel`, the run's ParallelState) of this rank's piece, with the exchanges' buffers."""
    from isotrain.models.unwrap import hf_model
    from isotrain.train.loss import loss_weights

    weights, _ = loss_weights(micro_batch["labels"], micro_batch["segment_ids"], "token")
    micro_batch, weights, attention = _context_parallel(micro_batch, weights, parallel)
    labels = micro_batch["labels"]
    parallel_loss = contextlib.nullcontext()
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as parallel_loss_context

        parallel_loss = parallel_loss_context()
    with parallel_loss, attention, exchange_buffers() as exchange:
        inner = hf_model(model)  # the Hugging Face model inside a DDP wrapper
        with count_saved(inner, decoder_layers(inner)) as saved:
            loss = forward_loss(model, micro_batch["input_ids"], micro_batch["position_ids"], labels, weights,
                                autocast_dtype, router=router, saved=saved, chunk_tokens=chunk_tokens)
        loss.backward()  # frees what was counted (FSDP2 also expects the backward of every forward)
    result = dict(saved.by_kind)
    result["exchange"] = exchange["bytes"]
    result["logits"] = saved.logits_bytes
    result["logits_numel"] = saved.logits_numel
    result["logits_fp32"] = saved.logits_dtype == torch.float32
    return result


def fsdp_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups of every fully_shard-ed module of `model` (private FSDP2 state, read only)."""
    return [group for module in model.modules() if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups]


def _gathered_bytes(groups, extra=()) -> int:
    """Bytes of FSDP2's all-gather buffers alive now: each group's flat all-gather output (issued, or kept by
    FSDP2 until the next group's copy-out in forward) and the unsharded parameters copied out of it, whose
    storages FSDP2 shrinks to 0 on reshard; `extra`: buffers the caller knows were alive at the moment sampled."""
    comm = groups[0].comm_ctx
    flat = [group._all_gather_result.all_gather_output for group in groups if group._all_gather_result]
    if comm.all_gather_state is not None:
        flat.append(comm.all_gather_state.all_gather_result.all_gather_output)
    return storage_bytes([*flat, *extra, *(t for group in groups for param in group.fsdp_params
                                           for t in [*param.all_gather_outputs,
                                                     getattr(param, "_unsharded_param", None)])])


def _unsharded_grad_bytes(groups) -> int:
    """Unsharded gradients waiting for their group's post-backward reduce-scatter."""
    return storage_bytes(t for group in groups for param in group.fsdp_params if hasattr(param, "_unsharded_param")
                         for t in (param._unsharded_param.grad, param.unsharded_accumulated_grad))


def _reduce_input_bytes(groups) -> int:
    """Reduce-scatter input buffers FSDP2 still holds (it keeps the last one until the next group's reduce)."""
    return storage_bytes(s.reduce_scatter_input for s in groups[0].comm_ctx.reduce_scatter_states)


@contextlib.contextmanager
def fsdp_buffers(model: nn.Module) -> Iterator[dict]:
    """Peak bytes of FSDP2's all-gather buffers ("gathered") and of unsharded gradients plus reduce-scatter
    inputs ("reduce") on this rank during the forward and backward run inside the context.

    Sampled after each group's all-gather is issued (`unshard`, also a backward prefetch), at each copy-out
    (`wait_for_unshard`) and around each post-backward. A copy-out writes the unsharded parameters while the flat
    all-gather output still exists; a post-backward copies the gradients into a new reduce-scatter input, after
    freeing the previous one, before it drops them. So those moments hold what is alive on return plus the flat
    output / the gradients seen on entry."""
    groups = fsdp_groups(model)
    peak = {"gathered": 0, "reduce": 0}
    if not groups:
        yield peak
        return

    def sample(extra=(), grads: int = 0) -> None:
        peak["gathered"] = max(peak["gathered"], _gathered_bytes(groups, extra))
        grads = max(grads, _unsharded_grad_bytes(groups))
        peak["reduce"] = max(peak["reduce"], grads + _reduce_input_bytes(groups))

    def sampled_after(original):
        def run(*args, **kwargs):
            result = original(*args, **kwargs)
            sample()
            return result
        return run

    def wait_for_unshard(group, original):
        def run(*args, **kwargs):
            flat = group._all_gather_result  # this reference only delays its release past the sample
            result = original(*args, **kwargs)
            sample(extra=[flat.all_gather_output] if flat else ())
            return result
        return run

    def post_backward(original):
        def run(*args, **kwargs):
            sample()
            grads = _unsharded_grad_bytes(groups)
            result = original(*args, **kwargs)
            sample(grads=grads)
            return result
        return run

    for group in groups:
        group.unshard, group.pre_backward = sampled_after(group.unshard), sampled_after(group.pre_backward)
        group.wait_for_unshard = wait_for_unshard(group, group.wait_for_unshard)
        group.post_backward = post_backward(group.post_backward)
    try:
        yield peak
    finally:
        for group in groups:  # back to the class's methods
            del group.unshard, group.pre_backward, group.wait_for_unshard, group.post_backward


def measure_terms(model: nn.Module, optimizer: torch.optim.Optimizer, options, batches: tuple[dict, dict],
                  device: torch.device) -> dict[str, int]:
    """Every term of the estimate (memory/estimate.py), by name, read off the live rank: one real `train_step` on
    `batches[0]` (gradients taken between backward and update, optimizer state after it), then what one more
    forward of `batches[1]` keeps for backward, and FSDP2's buffers at their peak during that forward and backward."""
    from isotrain.train.step import train_step

    measured = {"parameters": parameter_bytes(model)}
    train_step(model, optimizer, [batches[0]], 1e-3, options, device,
               before_update=lambda: measured.update(gradients=gradient_bytes(model)))
    measured["optimizer moments"] = optimizer_bytes(optimizer)
    on_device = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batches[1].items()}
    with fsdp_buffers(model) as buffers:
        saved = activation_bytes(model, on_device, options.autocast_dtype, options.loss_parallel, options.router,
                                 options.loss_chunk_tokens, options.parallel)
    if fsdp_groups(model):
        measured["FSDP2 all-gather buffers"] = buffers["gathered"]
        measured["FSDP2 reduce-scatter buffers"] = buffers["reduce"]
    measured["activations"] = saved["activations"]
    measured["compute copies"] = saved["compute_copies"]
    upcast = 0 if saved["logits_fp32"] else saved["logits_numel"] * 4
    measured["logits and loss"] = saved["logits_loss"] + saved["logits"] + upcast
    if options.router is not None:
        measured["router logits and terms"] = saved["router"]
    if options.parallel is not None and options.parallel.dims.cp > 1:
        measured["context-parallel exchange buffers"] = saved["exchange"]
    return measured
