"""The tokenization cache is built by one rank per file system that holds it (parallel/dist.py local_main_first with
shared_dir): once for a job whose nodes share the cache directory, once per node when each node has its own; every
other rank reads what was built, after it was built. Four real processes pose as two nodes of two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("builders_worker.py"))


@pytest.mark.slow
def test_a_shared_cache_is_built_once_and_a_node_local_one_once_per_node(tmp_path):
    roots = {layout: tmp_path / layout for layout in ("shared", "node-local")}
    for root in roots.values():
        root.mkdir()
    proc = run_forked_ranks(4, [str(tmp_path)], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {layout: [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(4)]
               for layout, root in roots.items()}
    # [what work() found, the entry, whether it was told it runs first]
    assert results["shared"] == [["built", "rank 0", True], ["read", "rank 0", False], ["read", "rank 0", False],
                                 ["read", "rank 0", False]]
    assert results["node-local"] == [["built", "rank 0", True], ["read", "rank 0", False], ["built", "rank 2", True],
                                     ["read", "rank 2", False]]
    assert sorted(p.name for p in (roots["shared"] / "shared").iterdir()) == ["entry"]  # the probe is gone
