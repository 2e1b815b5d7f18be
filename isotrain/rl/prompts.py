"""The prompt stream of an RL run: which prompts generation round k draws.

Round k draws the k-th batch of `rl.prompts_per_step` prompts of a `GlobalBatchSampler` over the
prompt rows, so the stream is a function of (seed, data, P) only (invariant 3): a run resumed on
any number of ranks draws exactly the next prompts. Rank r generates for the contiguous slice
[r·P/DP, (r+1)·P/DP) of each round. Dynamic sampling may use several rounds per RL step, so the
checkpoint counts rounds, not steps.

A weighted mixture of prompt sources (`data.sources`) is SFT's (data/mixture.py, `MixtureOrder`): the prompts are
the sources' concatenation, and round k draws the k-th batch of the mixture's epochs, a function of (seed, sources,
weights and sizes, P) only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from isotrain.data.cache import source_fingerprint
from isotrain.data.mixture import MixtureOrder
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.data.sources import read_rows
from isotrain.errors import DataError


@dataclass
class PromptSet:
    prompts: list[str]
    answers: list[str]  # the reference the reward compares with (`completion` of a prompt_completion row)
    num_skipped: int


def read_prompts(path: str, max_rows: int | None = None, field: str = "data.path") -> PromptSet:
    """Prompt rows of a prompt_completion file: `prompt` is generated from, `completion` is the reference answer."""
    if not path:
        raise DataError("RL needs prompts: set data.path to a prompt_completion file ({prompt, completion} rows)")
    result = read_rows(path, "prompt_completion", field)
    rows = result.rows[:max_rows] if max_rows is not None else result.rows
    if not rows:
        raise DataError(f"{field}={path!r} has no valid prompt rows; each row needs prompt and completion strings")
    return PromptSet([row["prompt"] for row in rows], [row["completion"] for row in rows], len(result.skipped))


def read_prompt_sources(sources, seed: int, prompts_per_round: int) -> tuple[PromptSet, MixtureOrder]:
    """The prompts of every source of a mixture (`data.sources`), concatenated in order, and their mixture in
    rounds of `prompts_per_round`."""
    parts = [read_prompts(source.path, field=f"data.sources[{i}].path") for i, source in enumerate(sources)]
    prompts = PromptSet([p for part in parts for p in part.prompts], [a for part in parts for a in part.answers],
                        sum(part.num_skipped for part in parts))
    order = MixtureOrder([len(part.prompts) for part in parts], [source.weight for source in sources],
                         [source.label for source in sources], seed, prompts_per_round)
    return prompts, order


def prompts_fingerprint(path: str | None, sources: list[tuple[str, float]]) -> str:
    """What a resume must match: data.path's data, or every source's (path, weight): its data and weight, in order."""
    if not sources:
        return source_fingerprint(path)
    spec = [[source_fingerprint(source, f"data.sources[{i}].path"), repr(float(weight))]
            for i, (source, weight) in enumerate(sources)]
    return "mixture-" + hashlib.sha256(json.dumps(spec).encode()).hexdigest()


class PromptStream:
    def __init__(self, num_prompts: int, prompts_per_round: int, seed: int, mixture: MixtureOrder | None = None):
        self.sampler = GlobalBatchSampler(num_prompts if mixture is None else mixture.epoch_samples, prompts_per_round,
                                          seed,
                                          epoch_table=mixture.epoch_table if mixture is not None else None)

    def round_indices(self, round_index: int, dp_rank: int, dp_size: int) -> list[int]:
        """This rank's prompt indices in generation round `round_index`."""
        return [int(i) for i in self.sampler.rank_slice(round_index, dp_rank, dp_size)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()
