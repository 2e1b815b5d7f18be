"""Mixture-of-experts models under pipeline parallelism: beside expert parallelism, with a stage of dense layers only,
through middle stages, and with the `micro_batch` aux-loss scope.

Tiny Qwen3-MoE (4 experts, top-2, aux 0.5, z 0.01), 3 steps on packed rows (two documents each, padded to the longest
row), on 4 ranks, against one process: fp32 losses, counts and first-step gradients within 1e-6 (where fp32 runs),
fp64 losses, first-step gradients, weights after 3 steps and every step's aux, z and norm within 1e-11.

- PP 2 × DDP 2 × EP 2: the EP groups are carved out of each stage's DP ranks, a stage's experts sharded over its own
  group (2 of 4 per rank); its checkpoint holds one process's tensors under the Hugging Face names, and transformers
  loads it on one process. The control sums the experts' gradients over the stage's DP replicas as the dense ones are
  (ranks that hold different experts): it fails.
- PP 2 × FSDP2 2 × EP 2 with layer 0 dense: the first stage routes nothing (no experts, no router terms), the last
  counts the routed tokens.
- PP 4 (1F1B, one MoE layer per stage) with `micro_batch` scope, against one process with the same 4 micro-batches:
  each micro-batch's pool is its counts of all four stages' layers (from the pre-pass); the two middle stages read no
  data, and route with the position and segment ids of the first (train/stage_data.py: padding is no token).
- Two stages per rank under each several-stage schedule (interleaved_1f1b, interleaved_zb, zbv, dualpipev), beside
  DDP, FSDP2 and EP: each rank forms each held stage's terms.
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
REFERENCE = ((1, 1, 1), 8)  # 1 process, the global batch of 8 rows in one micro-batch
# (layout, micro-batch size, packed): (dp_replicate, dp_shard, tp, ep, "ppN-schedule"); GA 2 on each DP rank.
EP_RUN = ((2, 1, 1, 2, "pp2-1f1b"), 2, True)
DENSE_FIRST_RUN = ((1, 2, 1, 2, "pp2-1f1b"), 2, True)
PP4_RUN = ((1, 1, 1, "pp4-1f1b"), 2, True)


def _launch(tmp_path, run, *flags: str) -> dict:
    (*degrees, pipeline), micro, _ = run
    out = tmp_path / "pp-moe.pt"
    spec = "x".join(map(str, degrees)) + f"/{pipeline}:{micro}"
    proc = run_forked_ranks(4, [str(out), spec, "packings=1", *flags], script=WORKER)
    assert proc.returncode == 0, failure(proc)
    return torch.load(out)


def _single(layers: int = 2, micro_batch: int = 8, **kwargs) -> dict:
    from pp_moe_worker import run_all

    return run_all([((1, 1, 1), micro_batch)], layers=layers, packings=(True,), **kwargs)


@pytest.fixture(scope="module")
def reference():
    return _single()


def _fp64_difference(results: dict, run, reference: dict, family: str = "qwen3_moe", scope: str = "global",
                     reference_micro_batch: int = 8) -> tuple[bool, float]:
    """(every step's expert counts equal, the largest fp64 relative difference) from one process's run."""
    layout, micro, packed = run
    got = results[(family, scope, packed, FP64, layout, micro)]
    want = reference[(family, scope, packed, FP64, (1, 1, 1), reference_micro_batch)]
    scalars = max(abs(a - b) / abs(b) for key in ("aux", "z", "norms")
                  for a, b in zip(got[key], want[key], strict=True))
    return got["counts"] == want["counts"], max(max_rel_diff(got, want, keys=("grads", "weights")), scalars)


@pytest.mark.slow
def test_pp2_with_expert_parallelism_matches_one_process_and_saves_its_checkpoint(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    results = _launch(tmp_path, EP_RUN, f"save={tmp_path}")
    assert_three_steps_equivalent(results, [EP_RUN], reference)
    layout, micro, packed = EP_RUN
    run = results[("qwen3_moe", "global", packed, FP64, layout, micro)]
    assert set(run["experts"].values()) == {((Shard(0),), (2, 64, 32))}, run["experts"]  # 2 of the 4 experts
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64).named_parameters())
    assert loaded.keys() == run["weights"].keys()
    assert all(torch.equal(loaded[name].detach(), run["weights"][name]) for name in loaded)


@pytest.mark.slow
def test_experts_summed_over_the_stage_replicas_fail_the_equivalence(tmp_path, reference):
    """The control: the stage's DP replicas (which hold different experts) sum their expert gradients as they sum
    the dense ones."""
    _, diff = _fp64_difference(_launch(tmp_path, EP_RUN, "dtypes=float64", "experts_in_replica_sum"), EP_RUN,
                               reference)
    assert diff > 1000 * RTOL, diff


@pytest.mark.slow
def test_a_stage_of_dense_layers_beside_fsdp2_and_expert_parallelism_matches_one_process(tmp_path):
    family = "qwen3_moe_dense_first"
    reference = _single(dtypes=(torch.float64,), family=family)
    results = _launch(tmp_path, DENSE_FIRST_RUN, "dtypes=float64", f"family={family}")
    counts_equal, diff = _fp64_difference(results, DENSE_FIRST_RUN, reference, family)
    assert counts_equal and diff <= 1e-11, diff


@pytest.mark.slow
def test_pp4_micro_batch_scope_through_middle_stages_matches_one_process(tmp_path):
    reference = _single(layers=4, micro_batch=2, dtypes=(torch.float64,), scope="micro_batch")
    results = _launch(tmp_path, PP4_RUN, "layers=4", "dtypes=float64", "scope=micro_batch")
    counts_equal, diff = _fp64_difference(results, PP4_RUN, reference, scope="micro_batch", reference_micro_batch=2)
    assert counts_equal and diff <= 1e-11, diff


# Several stages per rank (4 layers, one per stage): rank r of the interleaved schedules holds stages r and r + 2, of
# zbv and dualpipev stages r and 3 - r (rank 0: the first and the last); with EP 2 each stage's experts shard over its
# rank's EP group. GA 2 on each DP rank; dualpipev needs 2·pp micro-batches: GA 4 (micro-batch size 1).
STAGES_RUNS = (((2, 1, 1, 1, "pp2x2-interleaved_1f1b"), 2, True), ((1, 2, 1, 2, "pp2x2-interleaved_1f1b"), 2, True),
               ((2, 1, 1, 2, "pp2x2-zbv"), 2, True), ((2, 1, 1, 2, "pp2x2-interleaved_zb"), 2, True),
               ((2, 1, 1, 1, "pp2x2-dualpipev"), 1, True))
MICRO_BATCH_SCOPE_RUN = ((2, 1, 1, 2, "pp2x2-zbv"), 2, True)  # micro_batch scope: 4 pools of 2 rows each


@pytest.mark.slow
def test_several_stages_per_rank_match_one_process(tmp_path):
    """Every several-stage schedule, 2 stages on each rank, in one launch: interleaved_1f1b beside DDP 2 and beside
    FSDP2 2 × EP 2, zbv and interleaved_zb beside DDP 2 × EP 2, dualpipev beside DDP 2; and zbv with `micro_batch`
    scope (each micro-batch's pool: its counts of all four layers). Every held stage's router terms against the pool
    of all four layers, the token count once: counts equal, first-step gradients, weights after 3 steps, aux, z and
    norms within 1e-11 of one process."""
    reference = _single(layers=4, dtypes=(torch.float64,))
    out = tmp_path / "pp-moe.pt"
    spec = ",".join("x".join(map(str, degrees)) + f"/{pipeline}:{micro}"
                    for (*degrees, pipeline), micro, _ in STAGES_RUNS)
    (*degrees, pipeline), micro, _ = MICRO_BATCH_SCOPE_RUN
    spec += "," + "x".join(map(str, degrees)) + f"/{pipeline}:{micro}:micro_batch"
    proc = run_forked_ranks(4, [str(out), spec, "packings=1", "layers=4", "dtypes=float64"], script=WORKER)
    assert proc.returncode == 0, failure(proc)
    results = torch.load(out)
    for run in STAGES_RUNS:
        counts_equal, diff = _fp64_difference(results, run, reference)
        assert counts_equal and diff <= 1e-11, (run, diff)
    reference = _single(layers=4, micro_batch=2, dtypes=(torch.float64,), scope="micro_batch")
    counts_equal, diff = _fp64_difference(results, MICRO_BATCH_SCOPE_RUN, reference, scope="micro_batch",
                                          reference_micro_batch=2)
    assert counts_equal and diff <= 1e-11, diff
