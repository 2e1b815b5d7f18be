"""Interleaved 1F1B beside FSDP2 (parallel/pp.py, parallel/apply.py `shard_stages`): each of a rank's stages is an
FSDP2 root of its own, whose gradients the schedule reduce-scatters over the stage's DP ranks once per step.

PP 2 × FSDP2 2 on 4 gloo processes, 2 stages of one decoder layer per rank (rank 0 of a pipeline holds stages 0 and
2, rank 1 stages 1 and 3), 2 micro-batches per DP rank: the losses of 3 steps, every first-step gradient and the
weights after 3 AdamW steps equal one process's (fp32 1e-6; fp64 1e-6 on weights and gradients, measured ~4e-13),
both loss reductions; and every rank reduces each of its 3 FSDP2 groups (a stage root with the embedding, or the
final norm and head, and its two layers) exactly once per step, not once per micro-batch. The control leaves the
last stage's root out of FSDP2: its norm and head gradients are one DP rank's part and the equivalence fails.
(End to end through `isotrain train`, with a checkpoint: tests/checkpoint/test_pipeline_fsdp_resume.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_equivalence import FP64, MICRO_BATCH, RTOL, _single, max_rel_diff
from test_pipeline_parallel import assert_pipeline_equivalent
from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("pipeline_fsdp_worker.py"))
FAMILY = "llama_4layers"
LAYOUT = "1x2x1:pp2-interleaved_1f1b"
KEY = (FAMILY, ("pp", 2, "interleaved_1f1b", (1, 2, 1)))
GROUPS_PER_RANK = 3  # a stage root (embedding; or norm + head; the other root holds no parameter) + 2 layers


def _run(tmp_path, *flags: str) -> dict:
    out = tmp_path / f"interleaved-fsdp-{'-'.join(flags)}.pt"
    proc = run_forked_ranks(4, [str(out), LAYOUT, str(MICRO_BATCH), f"families={FAMILY}", *flags], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)[KEY]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("interleaved-fsdp-ref"), micro_batch=8, family=FAMILY)


@pytest.mark.slow
def test_interleaved_pp2_fsdp2_matches_one_process_and_reduces_once_per_step(tmp_path, reference):
    result = _run(tmp_path)
    assert_pipeline_equivalent(result, reference)
    for run in result.values():
        assert run["reduces"] == [[GROUPS_PER_RANK] * 3] * 4, run["reduces"]


@pytest.mark.slow
def test_last_stage_root_left_unsharded_fails_the_equivalence(tmp_path, reference):
    """Without its FSDP2 root the last stage's norm and head are whole on each DP rank and their gradients are never
    summed over the two: the first stage's embedding stays exact, the head's gradient is off by far more than 1e-6."""
    broken, single = _run(tmp_path, "stage_unsharded", "fp64_token")[("token", FP64)], reference[("token", FP64)]
    torch.testing.assert_close(broken["grads"]["model.embed_tokens.weight"],
                               single["grads"]["model.embed_tokens.weight"], rtol=1e-10, atol=1e-14)
    assert max_rel_diff(broken, single, keys=("grads", "weights")) > 1e5 * RTOL



def test_interleaved_schedule_beside_fsdp2_is_accepted():
    from isotrain.config import ParallelConfig
    from isotrain.parallel.dims import resolve_dims

    dims = resolve_dims(ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, dp_shard=-1,
                                       dp_replicate=1), 4)
    assert (dims.pp, dims.pp_stages, dims.dp_shard, dims.fsdp) == (2, 4, 2, True)
