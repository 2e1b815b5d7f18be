"""The tokenization cache is built by one rank per file system that holds it (parallel/dist.py
once_per_file_system): once for a job whose nodes share the cache directory, once per node when each node has its
own; every other rank reads what was built. Four real processes pose as two nodes of two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import torchrun

WORKER = str(Path(__file__).with_name("builders_worker.py"))


@pytest.mark.slow
def test_a_shared_cache_is_built_once_and_a_node_local_one_once_per_node(tmp_path):
    roots = {layout: tmp_path / layout for layout in ("shared", "node-local")}
    for root in roots.values():
        root.mkdir()
    proc = torchrun(4, [WORKER, str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {layout: [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(4)]
               for layout, root in roots.items()}
    # [what work() found, the entry, the barriers passed before it ran: 1 for the builders, 2 for the others]
    assert results["shared"] == [["built", "rank 0", 1], ["read", "rank 0", 2], ["read", "rank 0", 2],
                                 ["read", "rank 0", 2]]
    assert results["node-local"] == [["built", "rank 0", 1], ["read", "rank 0", 2], ["built", "rank 2", 1],
                                     ["read", "rank 2", 2]]
    assert sorted(p.name for p in (roots["shared"] / "shared").iterdir()) == ["entry"]  # the probe is gone
