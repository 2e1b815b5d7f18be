"""Pipeline parallelism (parallel.pp) against one process: the loss of each of 3 steps, the token counts, every
first-step gradient and the weights after 3 AdamW steps, both loss reductions, fp32 and fp64, with the equivalence
machinery of test_equivalence.py unchanged (same data: variable lengths, padding, masked prompts, one packed sample;
the same tolerances), on a 4-layer Llama (2 decoder layers per stage).

Layouts: PP 2 with GPipe and with 1F1B (and 1F1B with activation checkpointing), each running the batch plan's 4
gradient-accumulation micro-batches (global batch 8, micro-batch 2, DP 1) through 2 stages on 2 gloo processes. Each
rank holds its stage's tensors only; the worker gathers them by name to compare with one process's.

Beside data and tensor parallelism (4 gloo processes, a `pp × dp × tp` mesh): PP 2 × FSDP2 2 and PP 2 × DDP 2, each
with 1F1B and GPipe, run the batch plan's 2 micro-batches per DP rank (global batch 8, micro-batch 2, DP 2); PP 2 ×
TP 2 with each schedule runs 4 (DP 1), the last stage's logits sharded over the vocabulary. On 8 processes the 3-D
meshes PP 2 × FSDP2 2 × TP 2 and PP 2 × DDP 2 × TP 2, and PP 2 × HSDP 2×2. PP 2 × TP 2 on Qwen3 (per-head q/k norms
whose gradients TP sums) too, and without that sum the run stops naming the parameter. Two controls break one
reduction each and fail: the step's counts summed over the world (DP × PP) instead of DP, which halves the loss and every gradient, and
the last stage's gradients left unsummed over its DDP replicas.

Each rank builds its stage and schedule once for each padded shape of the micro-batches (the longest of the step
over DP) and reuses it: the 3 steps here have 2 shapes, and every equivalence test also checks that only 2 were built.

Tied embeddings (a copy of the weight on the first and on the last stage, their gradients summed over the two) on PP
2 (1F1B, GPipe), PP 2 × FSDP2 2, × DDP 2, × TP 2 and PP 4 compare the gradient norms too and check that the two copies
stay bitwise equal; without the sum the equivalence fails. Interleaved 1F1B (2 stages per rank: 4 one-layer stages)
alone, with activation checkpointing, beside DDP 2 and TP 2, and with tied embeddings.

The control: torch's schedules divide every gradient by the number of micro-batches unless built with
`scale_grads=False`. With that scaling on, the losses stay those of one process but every gradient is a quarter of
it, and the equivalence check fails.
"""

from __future__ import annotations

import pytest
import torch

from test_equivalence import FP64, MICRO_BATCH, WORKER, _single, assert_equivalent, max_rel_diff
from zygote import run_forked_ranks

FAMILY = "llama_4layers"
GPIPE = (FAMILY, ("pp", 2, "gpipe"))
ONE_F_ONE_B = (FAMILY, ("pp", 2, "1f1b"))
GRAD_ACCUM = 8 // MICRO_BATCH  # the worker's global batch of 8 on one DP rank


def assert_pipeline_equivalent(result: dict, reference: dict) -> None:
    """assert_equivalent, and each stage and schedule built once per padded shape of the 3 steps, then reused."""
    assert_equivalent(result, reference)
    for run in result.values():
        assert run["pipeline"]["builds"] == run["pipeline"]["shapes"] < 3, run["pipeline"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("pp-ref"), micro_batch=8, family=FAMILY)


def _pipeline(tmp_path, layouts: list[str], *flags: str, nproc: int = 2, family: str = FAMILY) -> dict:
    out = tmp_path / f"{family}-{nproc}-{'-'.join(flags)}.pt"
    proc = run_forked_ranks(nproc, [str(out), ",".join(layouts), str(MICRO_BATCH), f"families={family}", *flags],
                            script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_pp2_gpipe_and_1f1b_match_single_process(tmp_path, reference):
    results = _pipeline(tmp_path, ["1x1x1:pp2-gpipe", "1x1x1:pp2-1f1b"])
    for key in (GPIPE, ONE_F_ONE_B):
        assert_pipeline_equivalent(results[key], reference)


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


def _with(degrees: list[str], schedules=("1f1b", "gpipe")) -> dict:
    """{worker layout: results key} of PP 2 beside the given dp_replicate x dp_shard x tp degrees."""
    return {f"{layout}:pp2-{schedule}": (FAMILY, ("pp", 2, schedule, tuple(int(x) for x in layout.split("x"))))
            for layout in degrees for schedule in schedules}


WITH_DP = _with(["1x2x1", "2x1x1", "1x1x2"])  # FSDP2 2, DDP 2, TP 2
WITH_3D = {**_with(["1x2x2", "2x1x2"], ["1f1b"]), **_with(["2x2x1"], ["gpipe"])}  # FSDP2 × TP, DDP × TP, HSDP


@pytest.mark.slow
def test_pp2_with_fsdp2_ddp_and_tp_matches_single_process(tmp_path, reference):
    """PP 2 × FSDP2 2, PP 2 × DDP 2 and PP 2 × TP 2, 1F1B and GPipe: counts, losses, gradients and weights of one
    process."""
    results = _pipeline(tmp_path, list(WITH_DP), nproc=4)
    for key in WITH_DP.values():
        assert_pipeline_equivalent(results[key], reference)


@pytest.mark.slow
def test_pp2_on_3d_meshes_matches_single_process(tmp_path, reference):
    """8 processes: PP 2 × FSDP2 2 × TP 2 and PP 2 × DDP 2 × TP 2 (1F1B), PP 2 × HSDP 2×2 (GPipe)."""
    results = _pipeline(tmp_path, list(WITH_3D), nproc=8)
    for key in WITH_3D.values():
        assert_pipeline_equivalent(results[key], reference)


@pytest.mark.slow
def test_counts_summed_over_stages_fail_the_equivalence(tmp_path, reference):
    """The trained-token count summed over DP × PP counts every token twice: half the loss, half every gradient."""
    key = WITH_DP["1x2x1:pp2-1f1b"]
    result = _pipeline(tmp_path, ["1x2x1:pp2-1f1b"], "counts_over_pp", nproc=4)[key]
    with pytest.raises(AssertionError):
        assert_equivalent(result, reference)
    broken, single = result[("token", FP64)], reference[("token", FP64)]
    assert broken["counts"][0] == [2 * count for count in single["counts"][0]]
    assert broken["losses"][0] == pytest.approx(single["losses"][0] / 2, rel=1e-12)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(broken["grads"][name] * 2, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.slow
def test_a_stage_without_its_dp_reduction_fails_the_equivalence(tmp_path, reference):
    """PP 2 × DDP 2 without the last stage's gradient sum over its replicas: that stage's gradients are one replica's
    part (the first stage's stay exact), and the equivalence check fails."""
    key = WITH_DP["2x1x1:pp2-1f1b"]
    result = _pipeline(tmp_path, ["2x1x1:pp2-1f1b"], "stage_unreduced", nproc=4)[key]
    with pytest.raises(AssertionError):
        assert_equivalent(result, reference)
    broken, single = result[("token", FP64)], reference[("token", FP64)]
    assert broken["losses"][0] == pytest.approx(single["losses"][0], rel=1e-12)
    torch.testing.assert_close(broken["grads"]["model.embed_tokens.weight"], single["grads"]["model.embed_tokens.weight"],
                               rtol=1e-10, atol=1e-14)
    assert max_rel_diff(broken, single) > 0.1


@pytest.mark.slow
def test_pp2_tp2_on_qwen3_matches_and_a_missing_tp_sum_stops(tmp_path):
    """Qwen3's q/k norms see only their TP rank's heads; PP 2 × TP 2 (one layer per stage) matches one process, and
    without the TP sum of their gradients the replicas drift apart and the run stops naming the parameter."""
    key = ("qwen3", ("pp", 2, "1f1b", (1, 1, 2)))
    out = tmp_path / "qwen3.pt"
    proc = run_forked_ranks(4, [str(out), "1x1x2:pp2-1f1b", str(MICRO_BATCH), "families=qwen3"], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(torch.load(out)[key], _single(tmp_path, micro_batch=8, family="qwen3"))
    out = tmp_path / "unreduced.pt"
    proc = run_forked_ranks(4, [str(out), "1x1x2:pp2-1f1b", str(MICRO_BATCH), "families=qwen3", "unreduced"],
                            script=WORKER)
    assert proc.returncode != 0 and not out.exists()
    assert "self_attn.q_norm.weight is replicated over tensor-parallel ranks but differs between them" in proc.stderr


TIED = "llama_tied"  # tie_word_embeddings: one weight for the input embedding (first stage) and the head (last)


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("pp-tied-ref"), micro_batch=8, family=TIED)


def _tied(tmp_path, layouts: list[str], *flags: str, nproc: int = 2) -> dict:
    return _pipeline(tmp_path, layouts, *flags, nproc=nproc, family=TIED)


def assert_same_norms(result: dict, reference: dict) -> None:
    """The gradient norm, the tied weight counted once: of every step in fp64 (1e-12), of the first in fp32 (1e-6; as
    assert_equivalent compares fp32 gradients of the first step only, AdamW's g/√v magnifies fp32 rounding after it)."""
    for (reduction, dtype), run in result.items():
        expected = reference[(reduction, dtype)]["norms"]
        if dtype == FP64:
            assert run["norms"] == pytest.approx(expected, rel=1e-12), reduction
        else:
            assert run["norms"][0] == pytest.approx(expected[0], rel=1e-6), reduction


TIED_LAYOUTS = {"1x1x1:pp2-1f1b": (TIED, ("pp", 2, "1f1b")), "1x1x1:pp2-gpipe": (TIED, ("pp", 2, "gpipe"))}
TIED_WITH_DP = {"1x2x1:pp2-1f1b": (TIED, ("pp", 2, "1f1b", (1, 2, 1))),
                "2x1x1:pp2-gpipe": (TIED, ("pp", 2, "gpipe", (2, 1, 1))),
                "1x1x2:pp2-1f1b": (TIED, ("pp", 2, "1f1b", (1, 1, 2)))}


@pytest.mark.slow
def test_pp2_with_tied_embeddings_matches_single_process(tmp_path, tied_reference):
    """Tied embeddings under PP 2 (1F1B and GPipe; one decoder layer per stage): the first stage's copy of the weight
    and the last stage's, their gradients summed over the two stages, equal one process's one weight (gradient after
    step 1, weights after 3 steps), stay bitwise equal to each other, and the gradient norm counts the weight once."""
    results = _tied(tmp_path, list(TIED_LAYOUTS))
    for key in TIED_LAYOUTS.values():
        assert_pipeline_equivalent(results[key], tied_reference)
        assert_same_norms(results[key], tied_reference)
        for run in results[key].values():
            assert run["tied_copies_equal"] == [True, True], run["tied_copies_equal"]


@pytest.mark.slow
def test_pp2_with_tied_embeddings_beside_fsdp2_ddp_and_tp_matches_single_process(tmp_path, tied_reference):
    """PP 2 × FSDP2 2 (1F1B), PP 2 × DDP 2 (GPipe) and PP 2 × TP 2 (1F1B) with tied embeddings: each copy's gradient
    summed over its stage's DP ranks and over the two stages (under TP both copies are split by vocabulary rows
    alike, and their local parts are summed)."""
    results = _tied(tmp_path, list(TIED_WITH_DP), nproc=4)
    for key in TIED_WITH_DP.values():
        assert_pipeline_equivalent(results[key], tied_reference)
        assert_same_norms(results[key], tied_reference)
        for run in results[key].values():
            assert run["tied_copies_equal"] == [True, True], run["tied_copies_equal"]


@pytest.mark.slow
def test_tied_copies_without_their_gradient_sum_fail_the_equivalence(tmp_path, tied_reference):
    """Without the sum over the two stages each copy keeps its own stage's part of the gradient (the lookup's on the
    first, the head's on the last): the copies differ and the equivalence check fails."""
    key = TIED_LAYOUTS["1x1x1:pp2-1f1b"]
    result = _tied(tmp_path, ["1x1x1:pp2-1f1b"], "tied_unsummed")[key]
    with pytest.raises(AssertionError):
        assert_equivalent(result, tied_reference)
    assert all(run["tied_copies_equal"] == [False, False] for run in result.values())


@pytest.mark.slow
def test_pp4_with_tied_embeddings_matches_single_process(tmp_path):
    """PP 4 (one decoder layer per stage): the tied weight's copies are on stages 0 and 3, summed over a group of the
    two alone (the middle stages hold none)."""
    family = "llama_tied_4layers"
    result = _pipeline(tmp_path, ["1x1x1:pp4-1f1b"], nproc=4, family=family)[(family, ("pp", 4, "1f1b"))]
    reference = _single(tmp_path, micro_batch=8, family=family)
    assert_pipeline_equivalent(result, reference)
    assert_same_norms(result, reference)
    for run in result.values():
        assert run["tied_copies_equal"] == [True, True], run["tied_copies_equal"]


INTERLEAVED = (FAMILY, ("pp", 2, "interleaved_1f1b"))


@pytest.mark.slow
def test_pp2_interleaved_matches_single_process(tmp_path, reference):
    """Interleaved 1F1B, 2 stages per rank (4 stages of one decoder layer: rank 0 holds stages 0 and 2, rank 1 stages
    1 and 3), the 4 micro-batches in one round of 2."""
    assert_pipeline_equivalent(_pipeline(tmp_path, ["1x1x1:pp2-interleaved_1f1b"])[INTERLEAVED], reference)


@pytest.mark.slow
def test_pp2_interleaved_with_activation_checkpointing_matches_single_process(tmp_path, reference):
    """Each stage's view recomputes its own layers in backward (the layers are the rank's model's, shared)."""
    assert_equivalent(_pipeline(tmp_path, ["1x1x1:pp2-interleaved_1f1b"], "ac")[INTERLEAVED], reference)


@pytest.mark.slow
def test_interleaved_schedule_gradient_scaling_fails_the_equivalence(tmp_path, reference):
    """The interleaved schedule's own scaling (scale_grads=True) divides every gradient by the 4 micro-batches too."""
    result = _pipeline(tmp_path, ["1x1x1:pp2-interleaved_1f1b"], "scaled")[INTERLEAVED]
    with pytest.raises(AssertionError):
        assert_equivalent(result, reference)
    scaled, single = result[("token", FP64)], reference[("token", FP64)]
    for name, grad in single["grads"].items():
        torch.testing.assert_close(scaled["grads"][name] * GRAD_ACCUM, grad, rtol=1e-10, atol=1e-14)


INTERLEAVED_WITH = {"2x1x1:pp2-interleaved_1f1b": (FAMILY, ("pp", 2, "interleaved_1f1b", (2, 1, 1))),
                    "1x1x2:pp2-interleaved_1f1b": (FAMILY, ("pp", 2, "interleaved_1f1b", (1, 1, 2)))}


@pytest.mark.slow
def test_pp2_interleaved_with_ddp_and_tp_matches_single_process(tmp_path, reference):
    """Interleaved 1F1B (2 stages per rank) beside DDP 2 and beside TP 2 (4 processes)."""
    results = _pipeline(tmp_path, list(INTERLEAVED_WITH), nproc=4)
    for key in INTERLEAVED_WITH.values():
        assert_pipeline_equivalent(results[key], reference)


@pytest.mark.slow
def test_pp2_interleaved_with_tied_embeddings_matches_single_process(tmp_path):
    """Interleaved 1F1B with tied embeddings: the copies on rank 0 (stage 0 of 4) and rank 1 (stage 3)."""
    family = "llama_tied_4layers"
    result = _pipeline(tmp_path, ["1x1x1:pp2-interleaved_1f1b"], family=family)
    result = result[(family, ("pp", 2, "interleaved_1f1b"))]
    reference = _single(tmp_path, micro_batch=8, family=family)
    assert_pipeline_equivalent(result, reference)
    assert_same_norms(result, reference)
    for run in result.values():
        assert run["tied_copies_equal"] == [True, True], run["tied_copies_equal"]


# Packed data, one launch per world size: PP 2 with each schedule and FSDP2 2 without a pipeline on 2 processes;
# PP 4 (one layer per stage) and PP 2 × FSDP2 2 on 4.
PACKED = {2: {"1x1x1:pp2-1f1b": ONE_F_ONE_B, "1x1x1:pp2-gpipe": GPIPE, "1x2x1": (FAMILY, (1, 2, 1))},
          4: {"1x1x1:pp4-1f1b": (FAMILY, ("pp", 4, "1f1b")), "1x2x1:pp2-1f1b": WITH_DP["1x2x1:pp2-1f1b"]}}


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory):
    """One process on packed data (data.packing): 16 samples of 2 to 5 whole documents each."""
    return _single(tmp_path_factory.mktemp("pp-packed-ref"), micro_batch=8, family=FAMILY, packed=True)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """packed(nproc): the results of PACKED[nproc], launched once per module."""
    launched = {}

    def results(nproc: int) -> dict:
        if nproc not in launched:
            launched[nproc] = _pipeline(tmp_path_factory.mktemp(f"packed-{nproc}"), list(PACKED[nproc]), "packed",
                                        nproc=nproc)
        return launched[nproc]

    return results


@pytest.mark.slow
def test_pp2_with_packing_matches_single_process(packed, packed_reference):
    """Packed samples under PP 2, 1F1B and GPipe: every stage gets each micro-batch's position ids, whose restarts
    keep the documents apart in its attention; the packing probe, run through the two stages, finds them apart
    (position ids suffice, as on one process); counts, losses, gradients and weights are one process's."""
    for key in (ONE_F_ONE_B, GPIPE):
        assert_pipeline_equivalent(packed(2)[key], packed_reference)
        assert [run["probe_needs_mask"] for run in packed(2)[key].values()] == [False] * 4
    assert [run["probe_needs_mask"] for run in packed_reference.values()] == [False] * 4


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [(2, "1x2x1"), (4, "1x2x1:pp2-1f1b")], ids=["fsdp2", "pp2-fsdp2"])
def test_fsdp2_trains_from_its_shards_after_the_packing_probe(packed, packed_reference, nproc, layout):
    """The probe's forwards gather FSDP2's parameters and no backward reshards them: the probe reshards them itself
    (models/packing_check.py), and FSDP2 2 and PP 2 × FSDP2 2 on packed data match one process (left gathered, their
    weights after 3 steps were 1e-2 to 0.13 off)."""
    result = packed(nproc)[PACKED[nproc][layout]]
    assert_equivalent(result, packed_reference)
    assert [run["probe_needs_mask"] for run in result.values()] == [False] * 4


@pytest.mark.slow
def test_later_stages_without_document_boundaries_fail_the_equivalence(tmp_path, packed_reference):
    """The second stage given no position ids counts 0..L-1 along every packed row: its attention lets each
    document see the ones before it and the losses and gradients differ. The probe, run through the stages, sees
    it too: position ids no longer keep the documents apart there, and it would pass isotrain's mask."""
    result = _pipeline(tmp_path, ["1x1x1:pp2-1f1b"], "packed", "boundaries_first_stage_only")[ONE_F_ONE_B]
    with pytest.raises(AssertionError):
        assert_equivalent(result, packed_reference)
    assert max_rel_diff(result[("token", FP64)], packed_reference[("token", FP64)]) > 1e-3
    assert [run["probe_needs_mask"] for run in result.values()] == [True] * 4


@pytest.mark.slow
def test_pp4_middle_stages_read_no_data_and_match_single_process(packed, packed_reference):
    """PP 4 on packed data (one decoder layer per stage): only the ranks of the first and the last stage read
    samples (8 a step each), the two middle ranks none: they get each micro-batch's position ids and counts from
    the first stage (train/stage_data.py) and hold one process's counts as every rank does; the losses, gradients
    and weights are one process's."""
    result = packed(4)[PACKED[4]["1x1x1:pp4-1f1b"]]
    assert_pipeline_equivalent(result, packed_reference)
    for key, run in result.items():
        assert run["pipeline"]["reads"] == [24, 0, 0, 24], run["pipeline"]["reads"]
        assert run["pipeline"]["counts"] == [packed_reference[key]["counts"]] * 4
