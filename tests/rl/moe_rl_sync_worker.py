"""`isotrain rl ARGV` on a forked rank, recording the shape of every DTensor gathered whole (`full_tensor`).

Launched by test_moe_engine_sync.py:  moe_rl_sync_worker.py OUT_PREFIX ARGV...  Each rank writes the shapes it
gathered, as JSON, to OUT_PREFIX.rank<r>.json when the run ends (also when it fails).
"""

from __future__ import annotations

import json
import os
import sys

from torch.distributed.tensor import DTensor

import isotrain.cli

gathered: list[list[int]] = []
full_tensor = DTensor.full_tensor


def recording_full_tensor(self, *args, **kwargs):
    gathered.append(list(self.shape))
    return full_tensor(self, *args, **kwargs)


DTensor.full_tensor = recording_full_tensor
try:
    isotrain.cli.main(sys.argv[2:])
finally:
    with open(f"{sys.argv[1]}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump(gathered, f)
