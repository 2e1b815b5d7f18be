"""`isotrain rl ARGV` on a forked rank, recording the shape of every DTensor gathered whole (`full_tensor`).

Launched by test_moe_engine_sync.py:  moe_rl_sync_worker.py OUT_PREFIX ARGV...  Each rank writes the shapes it
gathered, as JSON, to OUT_PREFIX.rank<r>.json when the run ends (also when it fails).
"""

from __future__ import annotations

import json
import os
import sys

import isotrain.cli
from moe_sync_worker import record_full_tensors

gathered = record_full_tensors()
try:
    isotrain.cli.main(sys.argv[2:])
finally:
    with open(f"{sys.argv[1]}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump(gathered, f)
