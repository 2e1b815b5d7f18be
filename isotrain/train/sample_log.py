"""`data.log_samples`: which samples, and which source rows, every rank trained at every step.

Each rank appends one line per step to `<output_dir>/samples/rank-<r>.jsonl`:

    {"step": k, "samples": [[index, [row id, ...]], ...]}   k numbered like metrics.jsonl (1 = the first step)

`index` is the sample's place in the dataset the sampler indexes (for a mixture, in the concatenation of its
sources: data/mixture.py) and the row ids are those of the sample's documents (`shard << 40 | line` for a glob or
directory of shards: data/sources.py). The union of a step's lines over the ranks is its global batch, whatever
the layout. A run resumed at step k first drops every line after step k from every rank file, those of ranks
that this run does not have included, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

from isotrain.parallel.dist import barrier
from isotrain.train.metrics import rows_up_to


class SampleLog:
    def __init__(self, output_dir: Path, rank: int, is_main: bool, start_step: int):
        directory = Path(output_dir) / "samples"
        if is_main:
            directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(directory.glob("rank-*.jsonl")):
                kept = rows_up_to(path, start_step) if start_step > 0 else []
                path.write_text("".join(kept))
        barrier()  # no rank appends before rank 0 has cut every file back to start_step
        self._file = open(directory / f"rank-{rank:05d}.jsonl", "a")

    def write(self, step: int, indices: list[int], samples) -> None:
        """Step `step` (1-based) trained `samples`, the dataset's samples at `indices`, on this rank."""
        entries = [[int(index), [int(row) for row in sample.row_ids]] for index, sample in zip(indices, samples)]
        self._file.write(json.dumps({"step": step, "samples": entries}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
