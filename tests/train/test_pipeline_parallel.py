"""Pipeline parallelism (parallel.pp) against one process: the loss of each of 3 steps, the token counts, every
first-step gradient and the weights after 3 AdamW steps, both loss reductions, fp32 and fp64, with the equivalence
machinery of test_equivalence.py unchanged (same data: variable lengths, padding, masked prompts, one packed sample;
the same tolerances), on a 4-layer Llama (2 decoder layers per stage).

Layouts: PP 2 with GPipe and with 1F1B (and 1F1B with activation checkpointing), each running the batch plan's 4
gradient-accumulation micro-batches (global batch 8, micro-batch 2, DP 1) through 2 stages on 2 gloo processes. Each
rank holds its stage's tensors only; the worker gathers them by name to compare with one process's.

The control: torch's schedules divide every gradient by the number of micro-batches unless built with
`scale_grads=False`. With that scaling on, the losses stay those of one process but every gradient is a quarter of
it, and the equivalence check fails.
"""

from __future__ import annotations

import pytest
import torch

from test_equivalence import FP64, MICRO_BATCH, WORKER, _single, assert_equivalent
from zygote import run_forked_ranks

FAMILY = "llama_4layers"
GPIPE = (FAMILY, ("pp", 2, "gpipe"))
ONE_F_ONE_B = (FAMILY, ("pp", 2, "1f1b"))
GRAD_ACCUM = 8 // MICRO_BATCH  # the worker's global batch of 8 on one DP rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("pp-ref"), micro_batch=8, family=FAMILY)


def _pipeline(tmp_path, layouts: list[str], *flags: str) -> dict:
    out = tmp_path / f"pp-{'-'.join(flags)}.pt"
    proc = run_forked_ranks(2, [str(out), ",".join(layouts), str(MICRO_BATCH), f"families={FAMILY}", *flags],
                            script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_pp2_gpipe_and_1f1b_match_single_process(tmp_path, reference):
    results = _pipeline(tmp_path, ["1x1x1:pp2-gpipe", "1x1x1:pp2-1f1b"])
    for key in (GPIPE, ONE_F_ONE_B):
        assert_equivalent(results[key], reference)


@pytest.mark.slow
def test_schedule_gradient_scaling_fails_the_equivalence(tmp_path, reference):
    """scale_grads=True (torch's default): the same losses, every gradient divided by the 4 micro-batches."""
    result = _pipeline(tmp_path, ["1x1x1:pp2-1f1b"], "scaled")[ONE_F_ONE_B]
    with pytest.raises(AssertionError):
        assert_equivalent(result, reference)
    scaled, single = result[("token", FP64)], reference[("token", FP64)]
    assert scaled["losses"][0] == pytest.approx(single["losses"][0], rel=1e-12)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(scaled["grads"][name] * GRAD_ACCUM, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.slow
def test_pp2_with_activation_checkpointing_matches_single_process(tmp_path, reference):
    """Recomputing each stage's decoder layers in backward changes nothing (the reference keeps its activations)."""
    assert_equivalent(_pipeline(tmp_path, ["1x1x1:pp2-1f1b"], "ac")[ONE_F_ONE_B], reference)
