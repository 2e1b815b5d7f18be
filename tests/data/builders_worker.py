"""Run by tests/data/test_builders.py under torchrun with 4 processes posing as 2 nodes of 2 (local rank = rank % 2):
which rank builds a cache directory first, with one directory for all ("shared") or one per node ("node-local")."""

import json
import sys
from pathlib import Path

from isotrain.parallel.dist import init_distributed, local_main_first, shutdown_distributed

info = init_distributed()


def work(directory: Path, first: bool):
    entry = directory / "entry"
    if entry.exists():
        return ["read", entry.read_text(), first]
    entry.write_text(f"rank {info.rank}")
    return ["built", entry.read_text(), first]


for layout in ("shared", "node-local"):
    root = Path(sys.argv[1]) / layout
    directory = root / ("shared" if layout == "shared" else f"node{info.rank // 2}")
    result = local_main_first(info.rank % 2, lambda first: work(directory, first), shared_dir=directory)
    (root / f"rank{info.rank}.json").write_text(json.dumps(result))
shutdown_distributed()
