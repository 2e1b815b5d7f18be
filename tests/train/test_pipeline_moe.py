"""Mixture-of-experts models under pipeline parallelism beside expert parallelism, and through middle stages.

Tiny Qwen3-MoE (4 experts, top-2, aux 0.5, z 0.01), 3 steps on packed rows (two documents each, padded to the longest
row) against one process with the whole global batch in one micro-batch: fp32 losses, counts and first-step gradients
within 1e-6, fp64 gradients, weights after 3 steps and every step's aux, z and norm within 1e-11
(test_moe_equivalence.py's `three_step_differences`).

- PP 2 × DDP 2 × EP 2 and PP 2 × FSDP2 2 × EP 2 (4 ranks): the EP groups are carved out of each stage's DP ranks, a
  stage's experts sharded over its own group (2 of 4 per rank); a checkpoint written from PP 2 × DDP 2 × EP 2 holds
  one process's tensors under the Hugging Face names, and transformers loads it on one process. The control sums the
  experts' gradients over the stage's DP replicas as the dense ones are (ranks that hold different experts): it fails.
- PP 4 (1F1B, one MoE layer per stage): the two middle stages read no data; the position and segment ids they route
  with (padding is no token) come from the first stage (train/stage_data.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from helpers import failure
from test_equivalence import FP64, RTOL, max_rel_diff
from test_moe_equivalence import assert_three_steps_equivalent
from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("pp_moe_worker.py"))
REFERENCE = ((1, 1, 1), 8)
# (layout, micro-batch size, packed): (dp_replicate, dp_shard, tp, ep, "ppN-schedule"); GA 2 on each DP rank.
EP_RUNS = [((2, 1, 1, 2, "pp2-1f1b"), 2, True), ((1, 2, 1, 2, "pp2-1f1b"), 2, True)]
PP4_RUN = [((1, 1, 1, "pp4-1f1b"), 2, True)]


def _spec(runs) -> str:
    return ",".join("x".join(str(d) for d in layout[:-1]) + f"/{layout[-1]}:{micro}" for layout, micro, _ in runs)


def _launch(tmp_path, runs, *flags: str) -> dict:
    out = tmp_path / "pp-moe.pt"
    proc = run_forked_ranks(4, [str(out), _spec(runs), "packings=1", *flags], script=WORKER)
    assert proc.returncode == 0, failure(proc)
    return torch.load(out)


@pytest.fixture(scope="module")
def reference():
    from pp_moe_worker import run_all

    return run_all([REFERENCE], packings=(True,))


@pytest.mark.slow
def test_pp2_with_expert_parallelism_matches_one_process_and_saves_its_checkpoint(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    results = _launch(tmp_path, EP_RUNS, f"save={tmp_path}")
    assert_three_steps_equivalent(results, EP_RUNS, reference)
    for layout, micro, packed in EP_RUNS:
        experts = results[("qwen3_moe", "global", packed, FP64, layout, micro)]["experts"]
        # each rank holds its stage's one MoE layer, 2 of its 4 experts
        assert set(experts.values()) == {((Shard(0),), (2, 64, 32))}, experts
    layout, micro, packed = EP_RUNS[0]
    trained = results[("qwen3_moe", "global", packed, FP64, layout, micro)]["weights"]
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64).named_parameters())
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[name].detach(), trained[name]) for name in trained)


def _fp64_difference(results: dict, layout, micro_batch: int, reference: dict) -> tuple[bool, float]:
    """(every step's expert counts equal, the largest fp64 relative difference: losses, first-step gradients,
    weights after 3 steps, every step's aux, z and norm) from one process's run of the whole batch."""
    got = results[("qwen3_moe", "global", True, FP64, layout, micro_batch)]
    want = reference[("qwen3_moe", "global", True, FP64, *REFERENCE)]
    scalars = max(abs(a - b) / abs(b) for key in ("aux", "z", "norms") for a, b in zip(got[key], want[key], strict=True))
    return got["counts"] == want["counts"], max(max_rel_diff(got, want, keys=("grads", "weights")), scalars)


@pytest.mark.slow
def test_experts_summed_over_the_stage_replicas_fail_the_equivalence(tmp_path, reference):
    """The control: the stage's DP replicas (which hold different experts) sum their expert gradients as they sum
    the dense ones."""
    (layout, micro, _), = runs = EP_RUNS[:1]
    _, diff = _fp64_difference(_launch(tmp_path, runs, "dtypes=float64", "experts_in_replica_sum"), layout, micro,
                               reference)
    assert diff > 1000 * RTOL, diff


@pytest.mark.slow
def test_pp4_middle_stages_route_with_the_first_stage_ids_and_match_one_process(tmp_path):
    from pp_moe_worker import run_all

    reference = run_all([REFERENCE], layers=4, packings=(True,), dtypes=(torch.float64,))
    (layout, micro, _), = PP4_RUN
    counts_equal, diff = _fp64_difference(_launch(tmp_path, PP4_RUN, "layers=4", "dtypes=float64"), layout, micro,
                                          reference)
    assert counts_equal and diff <= 1e-11, diff
