"""parallel.pp_split (the decoder layers of each stage) and the zero-bubble schedules (parallel.pp_schedule
interleaved_zb, zbv, dualpipev) against one process, with the equivalence machinery of test_equivalence.py (3 steps,
both loss reductions, fp32 and fp64, counts, losses, first-step gradients, weights after 3 AdamW steps).

One 2-process launch on a 4-layer Llama with tied embeddings runs every layout (the hardest case of each: the tied
weight lives on the first and the last stage):
  - PP 2, 1F1B, parallel.pp_split=[3,1]: stage 0 holds the embedding and layers 0-2, stage 1 layer 3, the norm, the
    head (a copy of the tied weight) and the loss;
  - PP 2 with ScheduleInterleavedZeroBubble (4 one-layer stages, rank r holds stages r and r + 2), and with
    ScheduleZBVZeroBubble and ScheduleDualPipeV (4 one-layer stages in a V: rank 0 holds stages 0 and 3, so the
    embedding, the head and the loss, and one tied weight; rank 1 stages 1 and 2, and reads no data).
Each backward is split into its input and weight halves there (run at different times), and scale_grads=False: the
gradients are those of the global mean. fp64 agrees with one process to 1e-12 (the sums run in another order).

The memory estimate of an uneven split is the stages' own; bad splits are one sentence each.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_equivalence import FP64, MICRO_BATCH, WORKER, _single, assert_equivalent, max_rel_diff
from zygote import run_forked_ranks

FAMILY = "llama_tied_4layers"
LAYOUTS = {"1x1x1:pp2-1f1b-3+1": ("pp", 2, "1f1b", (3, 1)),
           "1x1x1:pp2-interleaved_zb": ("pp", 2, "interleaved_zb"),
           "1x1x1:pp2-zbv": ("pp", 2, "zbv"),
           "1x1x1:pp2-dualpipev": ("pp", 2, "dualpipev")}
FP64_RTOL = 1e-12
ONE_LAYER_STAGES = {0: [0], 1: [1], 2: [2], 3: [3]}
# (the stages of each rank, the decoder layers of each stage, the samples each rank read in the 3 steps)
PLACED = {"1x1x1:pp2-1f1b-3+1": ([[0], [1]], {0: [0, 1, 2], 1: [3]}, [24, 24]),
          "1x1x1:pp2-interleaved_zb": ([[0, 2], [1, 3]], ONE_LAYER_STAGES, [24, 24]),
          "1x1x1:pp2-zbv": ([[0, 3], [1, 2]], ONE_LAYER_STAGES, [24, 0]),
          "1x1x1:pp2-dualpipev": ([[0, 3], [1, 2]], ONE_LAYER_STAGES, [24, 0])}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(the results of every LAYOUTS layout on 2 processes, one process's)."""
    tmp = tmp_path_factory.mktemp("pp-split")
    out = tmp / "layouts.pt"
    proc = run_forked_ranks(2, [str(out), ",".join(LAYOUTS), str(MICRO_BATCH), f"families={FAMILY}", "packed"],
                            script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), _single(tmp, micro_batch=8, family=FAMILY, packed=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_and_zero_bubble_schedules_match_single_process(launched, layout):
    results, reference = launched
    result = results[(FAMILY, LAYOUTS[layout])]
    assert_equivalent(result, reference)
    for reduction in ("token", "sequence"):
        fp64 = result[(reduction, FP64)]
        assert max_rel_diff(fp64, reference[(reduction, FP64)], keys=("grads", "weights")) <= FP64_RTOL, reduction
        assert fp64["norms"] == pytest.approx(reference[(reduction, FP64)]["norms"], rel=FP64_RTOL)
    v_shaped = LAYOUTS[layout][2] in ("zbv", "dualpipev")
    for run in result.values():
        assert run["pipeline"]["builds"] == run["pipeline"]["shapes"] < 3, run["pipeline"]
        pipeline = run["pipeline"]
        assert (pipeline["rank_stages"], pipeline["stage_layers"], pipeline["reads"]) == PLACED[layout]
        assert run["probe_needs_mask"] is False  # the packing probe, run through the stages, keeps documents apart
        # two copies of the tied weight (first and last stage ranks) kept bitwise equal; one weight on a V's rank 0
        assert run["tied_copies_equal"] == ([] if v_shaped else [True, True]), run["tied_copies_equal"]
