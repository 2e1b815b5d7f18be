"""The weights a vLLM engine receives from a mixture-of-experts policy, in the layouts isotrain trains it in.

Launched by test_moe_weight_sync.py on 2 forked ranks (gloo):  moe_sync_worker.py OUT.json
For each layout (dp_replicate, dp_shard, tp, ep) the tiny Qwen3-MoE policy of engine_models.tiny_moe is
parallelised as `isotrain rl` does it (parallel/apply.py), then `saved_named_tensors` streams it: every rank
records each yielded (name, shape, sha256) and the shape of every DTensor that was gathered whole
(`full_tensor`); rank 0 writes them, with the same records of the plain one-process model, to OUT.json.
"""

from __future__ import annotations

import json
import sys

from torch.distributed.tensor import DTensor

import engine_models
from isotrain.models.weights import saved_named_tensors, tensor_sha256
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import gather_from_all, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel

LAYOUTS = {"ddp2_ep2": (2, 1, 1, 2), "fsdp2_ep2": (1, 2, 1, 2), "fsdp2": (1, 2, 1, 1)}


def moe_model():
    return engine_models.tiny_moe(engine_models.digits_tokenizer())  # the policy test_vllm_moe.py serves


def stream(model) -> list[list]:
    return [[name, list(t.shape), tensor_sha256(t)] for name, t in saved_named_tensors(model)]


def main(out_path: str) -> None:
    info = init_distributed()
    gathered: list[list[int]] = []
    full_tensor = DTensor.full_tensor

    def recording_full_tensor(self, *args, **kwargs):
        gathered.append(list(self.shape))
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = recording_full_tensor
    results = {"reference": stream(moe_model())}
    for name, (dp_replicate, dp_shard, tp, ep) in LAYOUTS.items():
        parallel = build_parallel(ParallelDims(dp_replicate, dp_shard, tp, ep=ep), info.device, info.rank)
        model = wrap_replicas(parallelize(moe_model(), parallel), parallel)
        gathered.clear()
        mine = {"stream": stream(model), "gathered": list(gathered)}
        results[name] = gather_from_all(mine)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
