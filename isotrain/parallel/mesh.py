"""Build the DeviceMesh for the resolved parallel degrees."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from isotrain.sizes import ParallelDegrees


def build_mesh(degrees: ParallelDegrees, device: torch.device) -> DeviceMesh | None:
    """A 2-D (dp_replicate, dp_shard) mesh; None for a single process."""
    if degrees.world_size == 1:
        return None
    return init_device_mesh(
        device.type,
        (degrees.dp_replicate, degrees.dp_shard),
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )
