"""The weights a vLLM engine receives from a mixture-of-experts policy, in the layouts isotrain trains it in.

Launched by test_moe_weight_sync.py on 4 forked ranks (gloo):  moe_sync_worker.py OUT.json
For each layout (dp_replicate, dp_shard, tp, ep) the tiny Qwen3-MoE policy of engine_models.tiny_moe (with 2 KV
heads and a vocabulary of 22, so that TP 2 splits it as `isotrain rl` accepts it) is parallelised as `isotrain rl`
does it (parallel/apply.py), then `saved_named_tensors` streams it: every rank records each yielded (name, shape,
sha256), the shape of every DTensor that was gathered whole (`full_tensor`) and the placements of the experts;
rank 0 writes them, with the same records of the plain one-process model, to OUT.json.

Two more entries hold placements no layout gives experts today (`OTHER_PLACEMENTS`: experts split on two mesh
dimensions, or along another dim than the expert dim): the one-process model's fused experts distributed that way on a
2 × 2 mesh, streamed the same way.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import engine_models
from isotrain.models.unwrap import hf_model
from isotrain.models.weights import saved_named_tensors, tensor_sha256
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import gather_from_all, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel

LAYOUTS = {"ddp4_ep2": (4, 1, 1, 2), "fsdp4_ep4": (1, 4, 1, 4), "fsdp4": (1, 4, 1, 1),
           "fsdp2_tp2_ep2": (1, 2, 2, 2), "ddp2_tp2_ep2": (2, 1, 2, 2), "fsdp2_tp2": (1, 2, 2, 1),
           "hsdp2x2": (2, 2, 1, 1), "hsdp2x2_ep2": (2, 2, 1, 2), "hsdp2x2_ep4": (2, 2, 1, 4)}
OTHER_PLACEMENTS = {"shard0_shard1": (Shard(0), Shard(1)), "shard1_replicate": (Shard(1), Replicate()),
                    "shard0_shard0": (Shard(0), Shard(0))}


def moe_model():
    model = engine_models.tiny_moe(engine_models.digits_tokenizer(), kv_heads=2, vocab_size=22)
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 22
    return model


def stream(model) -> list[list]:
    return [[name, list(t.shape), tensor_sha256(t)] for name, t in saved_named_tensors(model)]


def expert_placements(model) -> list[str]:
    return sorted({str(p.placements) for name, p in hf_model(model).named_parameters()
                   if ".experts." in name and isinstance(p, DTensor)})


def record_full_tensors() -> list[list[int]]:
    """From now on, the shape of every DTensor gathered whole (`full_tensor`) in this process, appended to the list
    returned."""
    gathered: list[list[int]] = []
    full_tensor = DTensor.full_tensor

    def recording_full_tensor(self, *args, **kwargs):
        gathered.append(list(self.shape))
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = recording_full_tensor
    return gathered


def main(out_path: str) -> None:
    info = init_distributed()
    gathered = record_full_tensors()
    results = {"reference": stream(moe_model())}
    for name, (dp_replicate, dp_shard, tp, ep) in LAYOUTS.items():
        parallel = build_parallel(ParallelDims(dp_replicate, dp_shard, tp, ep=ep), info.device, info.rank)
        model = wrap_replicas(parallelize(moe_model(), parallel), parallel)
        gathered.clear()
        mine = {"stream": stream(model), "gathered": list(gathered), "placements": expert_placements(model)}
        results[name] = gather_from_all(mine)
    mesh = init_device_mesh(info.device.type, (2, 2), mesh_dim_names=("a", "b"))
    for name, placements in OTHER_PLACEMENTS.items():
        model = moe_model()
        for module in model.modules():
            for key in ("gate_up_proj", "down_proj"):
                if getattr(module, key, None) is not None and module._parameters[key].ndim == 3:
                    module._parameters[key] = nn.Parameter(distribute_tensor(module._parameters[key].data, mesh,
                                                                             placements))
        gathered.clear()
        results[name] = gather_from_all({"stream": stream(model), "gathered": list(gathered),
                                         "placements": expert_placements(model)})
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
