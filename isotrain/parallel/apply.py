"""Apply parallelism to a built model, in one fixed order:

    pipeline stage -> tensor parallel | expert parallel | context parallel -> activation checkpointing
        -> torch.compile -> FSDP2 (or HSDP) | DDP

The pipeline split comes first (parallel/pp.py): a rank keeps only its stage's layers, embedding and head, and every
later step works on what is left.

TP first, because it changes what a parameter is (a DTensor shard on the "tp" axis); checkpointing and
compile then wrap the already-split computation; FSDP2 last, sharding over the data-parallel axes what
TP left (2-D DTensors under FSDP2 × TP). Everything but DDP works on the meta device, so a model is
parallelised before its weights exist and each rank materialises only its own shard (models/build.py).

Data-parallel gradients are SUMMED, never averaged: every micro-batch already divides by the *global*
number of trained tokens (or sequences), so the sum over DP ranks is exactly the gradient of the
global-batch mean (invariant 1).

Context parallelism (parallel/cp.py) only swaps the attention function; its ranks join the gradient sum as DP
ranks do (FSDP2 over dp_shard × cp, DDP or, under TP, `sync_replica_grads` over dp_replicate × cp:
parallel/mesh.py).

Expert parallelism (parallel/ep.py) makes the experts DTensors on the "ep" axis; FSDP2 and DDP leave them
out (FSDP2's ignored parameters, DDP's ignore list) and `sync_expert_grads` sums their gradients over the
ranks that hold the same experts instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from isotrain.parallel.cp import apply_cp
from isotrain.parallel.dist import all_reduce_flat
from isotrain.parallel.ep import apply_ep, expert_parameters, sync_expert_grads
from isotrain.parallel.mesh import ParallelState
from isotrain.parallel.pp import StageModule, apply_pp, keep_stage_roots, rank_stages, stage_roots


def _sum_allreduce_hook(process_group, bucket):
    """DDP comm hook: all-reduce SUM without DDP's division by the world size."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model: a causal LM's `model.model.layers`, a base
    decoder's own `layers` (AutoModel), or a BERT-style encoder's `encoder.layer`."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = getattr(getattr(base, "encoder", None), "layer", None)
    return list(layers) if layers is not None else []


def apply_activation_checkpointing(model: nn.Module, context_fn=None) -> None:
    """Recompute each decoder layer's activations in backward (transformers' own per-layer checkpointing:
    parameter names stay those of the Hugging Face model). The RNG state is restored for the recompute,
    so dropout masks, and with them the math, do not change. `context_fn`: torch.utils.checkpoint's (the
    contexts of a layer's forward and of its recompute), for dropout that does not draw from the RNG state
    (isotrain embed's keyed masks)."""
    if not decoder_layers(model):
        raise ValueError("activation checkpointing needs a model with decoder layers")
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers; the old name warns from 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_fsdp(model: nn.Module, parallel: ParallelState, compute_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2 per decoder layer, then the root (embeddings, final norm, head). HSDP when dp_replicate > 1."""
    # Parameters stay in their own dtype (fp32 master weights); with a compute dtype, FSDP2 casts
    # them for forward/backward and reduces gradients in fp32.
    if compute_dtype is None:
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    dp_mesh = parallel.dp_mesh()
    experts = set(expert_parameters(model)) or None  # sharded over "ep" already, reduced by sync_expert_grads
    # Several pipeline stages on a rank: each its own root, gathered and freed by the schedule (shard_stages).
    stages = parallel.dims.pp_stages_per_rank > 1
    for layer in decoder_layers(model):
        if next(layer.parameters(), None) is None:  # another pipeline stage's layer (parallel/pp.py PassThrough)
            continue
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=experts,
                    reshard_after_forward=False if stages else None)  # (None: FSDP2's default)
    if stages:
        shard_stages(model, parallel, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=experts)
    else:
        fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=experts)
    for module in [*model.modules(), *stage_roots(model)]:
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)
    return model


def shard_stages(model: nn.Module, parallel: ParallelState, **fsdp_kwargs) -> None:
    """FSDP2 under an interleaved schedule (parallel/pp.py): each of this rank's stages becomes a root of its own, the
    `StageModule` over the stage's view of `model` (whose decoder layers were sharded before, one unit each): its
    embedding, or final norm and head, are the root's. As torchtitan's pipeline stages, a stage's parameters stay
    gathered from the schedule's UNSHARD of the stage to its RESHARD (reshard_after_forward=False: no gather per
    micro-batch), and its gradients accumulate unsharded over the step's micro-batches and are reduce-scattered
    once, at the stage's REDUCE_GRAD. The roots are kept on the model (`stage_roots`), outside its module tree."""
    dims = parallel.dims
    stages = rank_stages(parallel.pp_rank, dims.pp, dims.pp_stages_per_rank, dims.pp_schedule)
    keep_stage_roots(model, [fully_shard(StageModule(model, stage, dims.pp_stages, dims.pp_stages_per_rank,
                                                     split=dims.pp_split),
                                         reshard_after_forward=False, **fsdp_kwargs) for stage in stages])


def materialise_stage_roots(model: nn.Module, device: torch.device) -> None:
    """After `model.to_empty`: FSDP2 roots outside the model's tree (`shard_stages`) point their sharded parameters
    at the new tensors (FSDPModule's `_apply` does it; `to_empty` on a root allocates its tensors once more)."""
    for root in stage_roots(model):
        root.to_empty(device=device)


def apply_ddp(model: nn.Module, parallel: ParallelState) -> nn.Module:
    group = parallel.replica_group()  # dp_replicate, × cp under context parallelism (parallel/mesh.py)
    experts = {id(p) for p in expert_parameters(model)}
    if experts:  # EP DTensors: not DDP's to broadcast or reduce (sync_expert_grads sums them)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if id(p) in experts])
    ddp = DistributedDataParallel(model, process_group=group, broadcast_buffers=False)
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    return ddp


def apply_compile(model: nn.Module) -> None:
    """torch.compile in place, one decoder layer at a time (the whole model only when it has no decoder layers).

    Never the root: transformers builds the attention mask in the root's forward, and traced by dynamo it
    materialises a [B, 1, S, S] mask even for full causal rows, so attention runs masked instead of `is_causal`
    with grouped KV heads repeated (3.1 x slower attention on an H200: docs/benchmarks.md). Per layer, FSDP2 wraps
    the compiled layers, and a root whose forward hooks change per call (the chunked loss's) still works."""
    layers = decoder_layers(model)
    for layer in layers:
        if next(layer.parameters(), None) is not None:  # not another pipeline stage's (parallel/pp.py PassThrough)
            layer.compile()
    if not layers:
        model.compile()


def parallelize(model: nn.Module, parallel: ParallelState, *, compute_dtype: torch.dtype | None = None,
                compile: bool = False, activation_checkpointing: bool = False, loss_parallel: bool = False,
                checkpoint_context_fn=None) -> nn.Module:
    """Everything up to the data-parallel wrapper that must come after the weights exist (`wrap_replicas`).

    `compute_dtype` (e.g. bf16) is used by FSDP2 only; DDP and single-process runs use autocast.
    `loss_parallel`: under TP, keep the LM head's logits sharded over the vocabulary (SFT's loss);
    otherwise they are gathered (RL needs every token's log-probability). `checkpoint_context_fn`: see
    `apply_activation_checkpointing`.
    """
    if parallel.dims.pp > 1:  # first: each rank keeps only its stage, which the other parallelisms then see
        dims = parallel.dims
        apply_pp(model, parallel.pp_rank, dims.pp, dims.pp_stages_per_rank, dims.pp_split, dims.pp_schedule)
    if parallel.dims.tp > 1:
        from isotrain.parallel.tp import apply_tp

        apply_tp(model, parallel.tp_mesh, loss_parallel)
    if parallel.ep_mesh is not None:
        apply_ep(model, parallel.ep_mesh, stage=parallel.dims.pp > 1)
    if parallel.dims.cp > 1:
        apply_cp(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model, checkpoint_context_fn)
    if compile:
        apply_compile(model)
    if parallel.dims.fsdp:
        apply_fsdp(model, parallel, compute_dtype)
    return model


def wrap_replicas(model: nn.Module, parallel: ParallelState, trainable: bool = True) -> nn.Module:
    """DDP over dp_replicate (× cp) when nothing is sharded over DP. It broadcasts nothing that matters (every
    rank loaded the same weights) but needs them to exist, so it comes after loading. Under TP the
    replicas' gradients are summed by `sync_replica_grads` instead (DDP does not take DTensors), and so are a
    pipeline stage's (a schedule runs the stage's forward, not DDP's)."""
    if not trainable or parallel.mesh is None or parallel.dims.fsdp or parallel.dims.tp > 1 or parallel.dims.pp > 1:
        return model
    if parallel.dims.dp_replicate * parallel.dims.cp > 1:
        return apply_ddp(model, parallel)
    return model


def sync_replica_grads(model: nn.Module, parallel: ParallelState) -> None:
    """TP × DDP, TP × CP and PP × DDP: sum every gradient over the dp_replicate (× cp) axes (what DDP's SUM hook
    does for plain tensors), where no DDP wrapper does.

    Under TP gradients are DTensors on the tp mesh; their local parts are what each replica computed for the
    same shard, so a plain all-reduce of the local parts over dp_replicate is the data-parallel sum. Under PP the
    dp_replicate group of a rank is that of its stage (the mesh's "dp_replicate" axis at its "pp" coordinate).
    Expert-parallel gradients are summed over their replicas here too (`sync_expert_grads`)."""
    sync_expert_grads(model, parallel.ep_mesh)
    dims = parallel.dims
    unwrapped = dims.tp > 1 or dims.pp > 1  # wrap_replicas put no DDP around the model
    if parallel.mesh is None or not unwrapped or dims.fsdp or dims.dp_replicate * dims.cp == 1:
        return
    group = parallel.replica_group()  # dp_replicate, × cp: each CP rank's gradient is its pieces' part
    # Not the experts: under EP the dp_replicate ranks hold different experts (summed above over their copies).
    experts = {id(p) for p in expert_parameters(model)}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    all_reduce_flat([g.to_local() if isinstance(g, DTensor) else g for g in grads], group)

