"""torchrun worker: every case on every given layout (dp × GA) in one launch; rank 0 saves the results.

    python -m torch.distributed.run --nproc-per-node DP gradcache_worker.py OUT.pt 2x1,2x2,fsdp2x1,hsdp2x2x1

A layout `fsdpDPxGA` shards the encoder with FSDP2 over the DP ranks (parallel.dp_shard=DP); `hsdpRxSxGA` is HSDP,
R replicas of an encoder sharded over S ranks (parallel.dp_replicate=R, parallel.dp_shard=S). Both also record
how the encoder was sharded (`sharding`).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `embed.embed_cases`

from embed.embed_cases import BF16_CASE, CASES, run_case, tiny_encoder  # noqa: E402
from isotrain.embed.encode import EncodeOptions, encode_chunk  # noqa: E402
from isotrain.embed.gradcache import gather_global  # noqa: E402
from isotrain.parallel.dims import ParallelDims  # noqa: E402
from isotrain.parallel.mesh import build_parallel  # noqa: E402


def gathered_tags(rank: int, size: int, per_rank: int = 3, num_negatives: int = 2) -> list[float]:
    """Each rank's rows carry their global sample index: query i -> i, positive -> 1000 + i,
    hard negative (i, j) -> 2000 + 10 i + j. Returns the first coordinate of the gathered documents."""
    samples = range(rank * per_rank, (rank + 1) * per_rank)
    q = torch.tensor([[float(i), 0.0] for i in samples])
    p = torch.tensor([[1000.0 + i, 0.0] for i in samples])
    n = torch.tensor([[2000.0 + 10 * i + j, 0.0] for i in samples for j in range(num_negatives)])
    ids = [t[:, 0].to(torch.int64) for t in (q, p, n)]
    queries, documents, query_ids, document_ids = gather_global(q, p, n, ids, dist.group.WORLD)
    assert torch.equal(documents[:, 0].to(torch.int64), document_ids) and torch.equal(queries[:, 0].to(torch.int64), query_ids)
    return documents[:, 0].tolist()


def sharding(parallel) -> dict:
    """How `parallelize` shards the encoder: its FSDP2 units, and the most parameter elements held unsharded at
    once during a forward (counted as each encoder layer starts its forward) against the whole model's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from isotrain.parallel.apply import parallelize

    model = parallelize(tiny_encoder().double(), parallel)
    layers = list(model.encoder.layer)  # BERT's blocks, named here rather than by the code under test
    unsharded = lambda: sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))  # noqa: E731
    most = []
    hooks = [layer.register_forward_pre_hook(lambda *_: most.append(unsharded())) for layer in layers]
    encode_chunk(model.eval(), [[1, 2, 3]], [0], EncodeOptions(), torch.device("cpu"))
    for hook in hooks:
        hook.remove()
    return {"num_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "num_layers": len(layers), "most_unsharded": max(most),
            "num_parameters": sum(p.numel() for p in tiny_encoder().parameters())}


def main(out: str, layouts: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {"tags": gathered_tags(rank, size)}
    for layout in layouts.split(","):
        *degrees, ga = map(int, layout.removeprefix("fsdp").removeprefix("hsdp").split("x"))
        replicas, shards = degrees if layout.startswith("hsdp") else (1, degrees[0])
        assert replicas * shards == size
        if layout.startswith(("fsdp", "hsdp")):
            sharded = build_parallel(ParallelDims(replicas, shards, 1), torch.device("cpu"), rank)
            results[(layout, "sharding")] = sharding(sharded)
            for case in CASES:
                results[(layout, case)] = run_case(case, sharded.dp_rank, size, ga, parallel=sharded)
                results[(layout, case, "fp32")] = run_case(case, sharded.dp_rank, size, ga, parallel=sharded,
                                                           dtype=torch.float32)
            results[(layout, BF16_CASE, "bf16")] = run_case(BF16_CASE, sharded.dp_rank, size, ga, parallel=sharded,
                                                            bf16=True)
            continue
        for case in CASES:
            results[(layout, case)] = run_case(case, rank, size, ga, dist.group.WORLD)
        results[(layout, BF16_CASE, "bf16")] = run_case(BF16_CASE, rank, size, ga, dist.group.WORLD, bf16=True)
        results[(layout, "control")] = run_case("hard_negatives", rank, size, ga, dist.group.WORLD, per_micro_batch=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
