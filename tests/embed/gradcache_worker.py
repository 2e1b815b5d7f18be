"""torchrun worker: every case on every given layout (dp × GA) in one launch; rank 0 saves the results.

    python -m torch.distributed.run --nproc-per-node DP gradcache_worker.py OUT.pt 2x1,2x2,fsdp2x1

A layout `fsdpDPxGA` shards the encoder with FSDP2 over the DP ranks (parallel.dp_shard=DP).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `embed.embed_cases`

from embed.embed_cases import CASES, run_case  # noqa: E402
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


def main(out: str, layouts: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {"tags": gathered_tags(rank, size)}
    sharded = None
    for layout in layouts.split(","):
        dp, ga = map(int, layout.removeprefix("fsdp").split("x"))
        assert dp == size
        if layout.startswith("fsdp"):
            sharded = sharded or build_parallel(ParallelDims(1, size, 1), torch.device("cpu"), rank)
            for case in CASES:
                results[(layout, case)] = run_case(case, rank, size, ga, parallel=sharded)
                results[(layout, case, "fp32")] = run_case(case, rank, size, ga, parallel=sharded, dtype=torch.float32)
            continue
        for case in CASES:
            results[(layout, case)] = run_case(case, rank, size, ga, dist.group.WORLD)
        results[(layout, "control")] = run_case("hard_negatives", rank, size, ga, dist.group.WORLD, per_micro_batch=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
