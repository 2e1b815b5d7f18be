"""Apply data parallelism to a built model, in one fixed order: (TP later) -> FSDP2 or DDP.

Both wrappers are set to SUM gradients over data-parallel ranks instead of averaging them:
every micro-batch already divides by the *global* number of trained tokens (or sequences), so
the summed gradient is exactly the gradient of the global-batch mean (invariant 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from isotrain.sizes import ParallelDegrees


def _sum_allreduce_hook(process_group, bucket):
    """DDP comm hook: all-reduce SUM without DDP's division by the world size."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (`model.model.layers`)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, degrees: ParallelDegrees, compute_dtype: torch.dtype | None
) -> nn.Module:
    """FSDP2 per decoder layer, then the root (embeddings, final norm, head). HSDP when dp_replicate > 1."""
    dp_mesh = mesh if degrees.dp_replicate > 1 else mesh["dp_shard"]
    # Parameters stay in their own dtype (fp32 master weights); with a compute dtype, FSDP2 casts
    # them for forward/backward and reduces gradients in fp32.
    if compute_dtype is None:
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)
    return model


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    group = mesh["dp_replicate"].get_group()
    ddp = DistributedDataParallel(model, process_group=group, broadcast_buffers=False)
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    return ddp


def apply_compile(model: nn.Module, degrees: ParallelDegrees) -> None:
    """torch.compile in place: each decoder layer when FSDP2 will wrap them, else the whole model."""
    if degrees.dp_shard > 1:
        for layer in decoder_layers(model):
            layer.compile()
    else:
        model.compile()


def parallelize(
    model: nn.Module, mesh: DeviceMesh | None, degrees: ParallelDegrees, compute_dtype: torch.dtype | None = None
) -> nn.Module:
    """`compute_dtype` (e.g. bf16) is only used by FSDP2; DDP and single-process runs use autocast."""
    if mesh is None:
        return model
    if degrees.dp_shard > 1:
        return apply_fsdp(model, mesh, degrees, compute_dtype)
    return apply_ddp(model, mesh)
