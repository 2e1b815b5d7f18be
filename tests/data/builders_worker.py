"""Run by tests/data/test_builders.py under torchrun with 4 processes posing as 2 nodes of 2 (local rank = rank % 2):
which rank builds a cache directory first, with one directory for all ("shared") or one per node ("node-local")."""

import json
import sys
from pathlib import Path

import isotrain.parallel.dist as dist_module
from isotrain.parallel.dist import DistInfo, init_distributed, once_per_file_system, shutdown_distributed

info = init_distributed()
barriers = [0]  # the barriers this rank has passed: a builder works after the first, the others after the second
real_barrier = dist_module.barrier


def counted_barrier():
    real_barrier()
    barriers[0] += 1


dist_module.barrier = counted_barrier
as_node = DistInfo(rank=info.rank, world_size=info.world_size, local_rank=info.rank % 2, device=info.device)


def work(directory: Path):
    entry = directory / "entry"
    if entry.exists():
        return ["read", entry.read_text(), barriers[0]]
    entry.write_text(f"rank {info.rank}")
    return ["built", entry.read_text(), barriers[0]]


for layout in ("shared", "node-local"):
    barriers[0] = 0
    root = Path(sys.argv[1]) / layout
    directory = root / ("shared" if layout == "shared" else f"node{info.rank // 2}")
    result = once_per_file_system(as_node, directory, lambda: work(directory))
    (root / f"rank{info.rank}.json").write_text(json.dumps(result))
shutdown_distributed()
