"""The MoE objective (cross-entropy + load-balancing aux loss + router z-loss) does not depend on the layout.

Tiny qwen3_moe and mixtral models (4 experts, top-2), 2 steps on variable-length, padded, prompt-masked rows and
on packed rows (two documents each). With `moe.aux_loss_scope=global` the loss (aux included), the aux loss and
expert counts of every step, and every first-step gradient (routers and experts included) equal the 1-process,
1-micro-batch reference within 1e-6 relative for GA 4, DDP 2 (1 and 2 micro-batches per rank) and FSDP2 2 (2 and 4
micro-batches per rank), in fp32 (tensor scale floored as in test_equivalence.py) and in fp64 (weights after 2 steps
too), and with activation checkpointing. `micro_batch` scope is the control: under GA 4 it differs by far more than
the tolerance. Context parallelism (CP 2 in both styles, CP 2 × EP 2) and pipeline parallelism (PP 2, 1F1B) run 3
steps against one process, each with a control that leaves the pool short and fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from helpers import failure
from zygote import run_forked_ranks
from test_equivalence import FP32, FP64, RTOL, SCALE_FLOOR, max_rel_diff

WORKER = str(Path(__file__).with_name("moe_worker.py"))
FAMILIES = ("qwen3_moe", "mixtral")
REFERENCE = ((1, 1, 1), 8)  # 1 process, the whole global batch of 8 rows in one micro-batch


@pytest.fixture(scope="module")
def single():
    """Every single-process run: the reference and GA 4; `micro_batch` scope only where its control reads it
    (unpacked, fp32)."""
    from moe_worker import run_all

    runs = [REFERENCE, ((1, 1, 1), 2)]
    return run_all(runs, scopes=("global",)) | run_all(runs, scopes=("micro_batch",), packings=(False,),
                                                        dtypes=(torch.float32,))


def assert_equivalent(results: dict, layout, micro_batch: int, reference: dict, scope: str = "global",
                      fp32_steps: int | None = None) -> None:
    """`fp32_steps=1`: fp32 losses of the first step only (tensor parallel layouts, see TP_RUNS); fp64 checks all."""
    for family in FAMILIES:
        for packed in (False, True):
            def pick(source, dtype, lay=layout, micro=micro_batch):
                return source[(family, scope, packed, dtype, lay, micro)]

            case = (family, packed, layout, micro_batch)
            fp32, ref32 = pick(results, FP32), pick(reference, FP32, *REFERENCE)
            fp64, ref64 = pick(results, FP64), pick(reference, FP64, *REFERENCE)
            assert fp32["counts"] == ref32["counts"], case
            for name in ("aux", "z"):
                for got, want in zip(fp64[name], ref64[name], strict=True):
                    assert abs(got - want) <= RTOL * abs(want), (case, name)
            first = {"losses": fp32["losses"][:fp32_steps]}
            assert max_rel_diff(fp32 | first, ref32 | {"losses": ref32["losses"][:fp32_steps]},
                                scale_floor=SCALE_FLOOR) <= RTOL, case
            assert max_rel_diff(fp64, ref64, keys=("grads", "weights")) <= RTOL, case
            # Clipping uses the norm: an element replicated over ranks (TP, EP copies) is counted once.
            # fp32: the first step's (later steps inherit AdamW's fp32 sensitivity); fp64: every step.
            for got, want in ((fp32["norms"][:1], ref32["norms"][:1]), (fp64["norms"], ref64["norms"])):
                assert all(abs(a - b) <= RTOL * b for a, b in zip(got, want, strict=True)), (case, got, want)


def test_gradient_accumulation_keeps_the_global_aux_loss(single):
    assert_equivalent(single, (1, 1, 1), 2, single)


def test_activation_checkpointing_keeps_the_global_aux_loss(single):
    """Recomputed decoder layers: the router logits the loss uses come from the first forward and backpropagate
    through the recomputation."""
    from moe_worker import run_all

    assert_equivalent(run_all([((1, 1, 1), 2)], scopes=("global",), checkpointing=True), (1, 1, 1), 2, single)


def test_micro_batch_scope_changes_with_gradient_accumulation(single):
    """The control: each micro-batch's own aux loss, averaged, is another objective under GA 4 (so the checks
    above can fail), while on one micro-batch it is the global one."""
    for family in FAMILIES:
        ga4 = single[(family, "micro_batch", False, FP32, (1, 1, 1), 2)]
        ga1 = single[(family, "micro_batch", False, FP32, *REFERENCE)]
        reference = single[(family, "global", False, FP32, *REFERENCE)]
        assert ga1["losses"][0] == pytest.approx(reference["losses"][0], rel=RTOL)
        assert ga1["aux"][0] == pytest.approx(reference["aux"][0], rel=RTOL)
        assert abs(ga4["aux"][0] - ga1["aux"][0]) > 1000 * RTOL * ga1["aux"][0], family
        assert max_rel_diff(ga4, reference) > 1000 * RTOL, family
        router = "model.layers.0.mlp.gate.weight"
        assert _rel(ga4["grads"][router], reference["grads"][router]) > 1000 * RTOL, family


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# (layout, micro-batch size): DDP 2 with 1 micro-batch per rank (counts all-reduced after the forward) and with 2
# (routing pre-pass); FSDP2 2 with 2 and with 4 micro-batches per rank.
PARALLEL_RUNS = [((2, 1, 1), 4), ((2, 1, 1), 2), ((1, 2, 1), 2), ((1, 2, 1), 1)]


@pytest.mark.slow
def test_parallel_layouts_keep_the_global_aux_loss(tmp_path, single):
    out = tmp_path / "moe-parallel.pt"
    runs = ",".join(f"{'x'.join(map(str, layout))}:{micro}" for layout, micro in PARALLEL_RUNS)
    proc = run_forked_ranks(2, [str(out), runs, "scopes=global"], script=WORKER)
    assert proc.returncode == 0, failure(proc)
    results = torch.load(out)
    for layout, micro in PARALLEL_RUNS:
        assert_equivalent(results, layout, micro, single)


def test_prepass_refuses_a_gradient_pass_that_routes_differently():
    """Router noise between the routing pre-pass and the gradient pass would make the global aux loss wrong: the
    step stops before its update, naming the cause."""
    from moe_worker import run_all

    from isotrain.errors import TrainingError

    with pytest.raises(TrainingError, match="expert choices of the gradient pass differ from the routing pre-pass"):
        run_all([((1, 1, 1), 2)], families=("qwen3_moe",), scopes=("global",), packings=(False,),
                dtypes=(torch.float32,), force_reroute=True)


# Tensor parallelism on MoE models: attention split, router and experts replicated over TP (their gradients
# complete on every TP rank; check_replicated runs after the first update), 1 and 2 micro-batches per rank.
# TP splits the inner sums of attention's matmuls over ranks, so fp32 gradients differ from one process's by
# rounding (< 1e-6 relative); AdamW's first update, ≈ lr·sign(g), turns that rounding on near-zero entries into
# weight differences of up to 2·lr, and the second step's fp32 loss moves by ~2e-6 (measured; fp64: ~1e-14). So
# under TP fp32 checks the first step's loss, gradients and norm, and fp64 every step's loss and the weights.
TP_RUNS = [((1, 1, 2), 8), ((1, 1, 2), 4)]
# Expert parallel × tensor parallel on 4 processes (dp_replicate, dp_shard, tp, ep): EP 2 × TP 2 with the dense
# parts replicated over DP (gradients summed over dp_replicate, experts left out of that sum) and with FSDP2 2.
EP_TP_RUNS = [((2, 1, 2, 2), 4), ((1, 2, 2, 2), 4)]
# The same on 8 processes with DP 4: each expert block is held by 2 EP groups (ep_replicate 2) and its gradient
# summed over them, beside the TP replicas.
EP_TP_REPLICATED_RUNS = [((4, 1, 2, 2), 2)]


def _launch(tmp_path, nproc: int, runs) -> dict:
    out = tmp_path / f"moe-{nproc}.pt"
    spec = ",".join(f"{'x'.join(map(str, layout))}:{micro}" for layout, micro in runs)
    proc = run_forked_ranks(nproc, [str(out), spec, "scopes=global"], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_tensor_parallel_moe_matches_one_process(tmp_path, single):
    results = _launch(tmp_path, 2, TP_RUNS)
    for layout, micro in TP_RUNS:
        assert_equivalent(results, layout, micro, single, fp32_steps=1)
    experts = results[("mixtral", "global", False, FP32, *TP_RUNS[0])]["experts"]
    assert experts and set(experts.values()) == {((Replicate(),), (4, 128, 32))}  # every expert on every TP rank


@pytest.mark.slow
def test_expert_parallel_with_tensor_parallel_matches_one_process(tmp_path, single):
    """Each TP rank of an EP group dispatches the same tokens to its own TP coordinate's expert owners; the
    experts are (Shard(0), Replicate()) on the ("ep", "tp") mesh, counted once in the clipping norm."""
    results = _launch(tmp_path, 4, EP_TP_RUNS)
    for layout, micro in EP_TP_RUNS:
        assert_equivalent(results, layout, micro, single, fp32_steps=1)
        experts = results[("qwen3_moe", "global", False, FP32, layout, micro)]["experts"]
        assert experts and set(experts.values()) == {((Shard(0), Replicate()), (2, 64, 32))}  # 2 of the 4 experts


@pytest.mark.slow
def test_expert_parallel_with_tensor_parallel_and_replicated_experts_matches_one_process(tmp_path, single):
    results = _launch(tmp_path, 8, EP_TP_REPLICATED_RUNS)
    for layout, micro in EP_TP_REPLICATED_RUNS:
        assert_equivalent(results, layout, micro, single, fp32_steps=1)
        experts = results[("qwen3_moe", "global", False, FP32, layout, micro)]["experts"]
        assert experts and set(experts.values()) == {((Shard(0), Replicate()), (2, 64, 32))}


# Context parallelism, layouts (dp_replicate, dp_shard, tp, ep, cp[, "ring"]): each rank routes its piece of every
# sequence, so the loads (counts, tokens) of the pool are summed over DP × CP, the pre-pass runs the pieces inside
# the same CP attention, and the experts' gradients are summed over "cp" beside "ep_replicate". 3 steps against one
# process (fp32: losses, counts, first-step gradients and norm; fp64: every step's aux, z and norm, gradients and the
# weights after 3 steps). qwen3_moe only: the router terms are the same code for every family.
# CP 2 Ulysses with GA 2 (routing pre-pass), ring CP 2 with one micro-batch (loads all-reduced after the forward),
# CP 2 × EP 2 with FSDP2 2 (4 ranks, GA 2); packed rows of two documents each, padded to the longest row (one launch
# runs the packings of all its runs).
STEPS_3 = 3
CP_RUNS = [((1, 1, 1, 1, 2), 4, True), ((1, 1, 1, 1, 2, "ring"), 8, True)]
CP_EP_RUNS = [((1, 2, 1, 2, 2), 2, True)]


@pytest.fixture(scope="module")
def three_step_reference():
    from moe_worker import run_all

    return run_all([REFERENCE], families=("qwen3_moe",), scopes=("global",), steps=STEPS_3)


def _launch_three_steps(tmp_path, nproc: int, runs, *flags: str, scope: str = "global") -> dict:
    out = tmp_path / f"moe-3-steps-{nproc}.pt"
    spec = ",".join("x".join(str(d) for d in layout if not isinstance(d, str))
                    + (f"/{layout[-1]}" if isinstance(layout[-1], str) else "") + f":{micro}"
                    for layout, micro, _ in runs)
    packings = ",".join(sorted({str(int(packed)) for *_, packed in runs}))
    proc = run_forked_ranks(nproc, [str(out), spec, f"scopes={scope}", "families=qwen3_moe", f"packings={packings}",
                                    f"steps={STEPS_3}", *flags], script=WORKER)
    assert proc.returncode == 0, failure(proc)
    return torch.load(out)


def three_step_differences(results: dict, layout, micro_batch: int, packed: bool, reference: dict,
                           scope: str = "global", reference_run=REFERENCE) -> dict:
    """The largest relative differences from one process (`reference_run`: its layout and micro-batch size): fp32
    (losses and first-step gradients) and fp64 (gradients, weights after 3 steps, every step's aux, z and norm);
    counts_equal: every step's expert counts."""
    def pick(source, dtype, lay=layout, micro=micro_batch):
        return source[("qwen3_moe", scope, packed, dtype, lay, micro)]

    fp32, ref32 = pick(results, FP32), pick(reference, FP32, *reference_run)
    fp64, ref64 = pick(results, FP64), pick(reference, FP64, *reference_run)
    scalars = max(abs(a - b) / abs(b) for key in ("aux", "z", "norms")
                  for a, b in zip(fp64[key], ref64[key], strict=True))
    return {"counts_equal": fp32["counts"] == ref32["counts"] and fp64["counts"] == ref64["counts"],
            "fp32": max_rel_diff(fp32, ref32, scale_floor=SCALE_FLOOR),
            "fp64": max(max_rel_diff(fp64, ref64, keys=("grads", "weights")), scalars)}


def assert_three_steps_equivalent(results: dict, runs, reference: dict, **kwargs) -> None:
    for layout, micro, packed in runs:
        diff = three_step_differences(results, layout, micro, packed, reference, **kwargs)
        assert diff["counts_equal"], layout
        assert diff["fp32"] <= RTOL, (layout, diff)
        assert diff["fp64"] <= 1e-11, (layout, diff)


@pytest.mark.slow
def test_context_parallel_moe_matches_one_process(tmp_path, three_step_reference):
    assert_three_steps_equivalent(_launch_three_steps(tmp_path, 2, CP_RUNS), CP_RUNS, three_step_reference)


@pytest.mark.slow
def test_context_parallel_with_expert_parallel_matches_one_process(tmp_path, three_step_reference):
    """With TP as well, on 8 ranks (one set of EP groups per CP and TP coordinate, experts (Shard(0), Replicate())
    on ("ep", "tp")), FSDP2 2 × TP 2 × EP 2 × Ulysses CP 2 and DDP 2 × TP 2 × EP 2 × ring CP 2 were measured equal to
    one process too (fp32 7.8e-7 and 7.1e-7, fp64 2.4e-13 and 1.7e-13) and are not in the suite (a minute on 2
    cores)."""
    results = _launch_three_steps(tmp_path, 4, CP_EP_RUNS)
    assert_three_steps_equivalent(results, CP_EP_RUNS, three_step_reference)
    experts = results[("qwen3_moe", "global", True, FP32, *CP_EP_RUNS[0][:2])]["experts"]
    assert experts and set(experts.values()) == {((Shard(0),), (2, 64, 32))}  # 2 of the 4 experts per CP rank


@pytest.mark.slow
def test_context_parallel_keeps_the_micro_batch_scope(tmp_path):
    """`micro_batch` scope under CP: a micro-batch's pool is all of its pieces (their loads summed over CP), so the
    objective is that of one process with the same micro-batches (GA 2); fp64 (the fp32 path is the global scope's)."""
    from moe_worker import run_all

    layout, micro = (1, 1, 1, 1, 2), 4
    key = ("qwen3_moe", "micro_batch", True, FP64)
    reference = run_all([((1, 1, 1), micro)], families=("qwen3_moe",), scopes=("micro_batch",), packings=(True,),
                        dtypes=(torch.float64,), steps=STEPS_3)[(*key, (1, 1, 1), micro)]
    results = _launch_three_steps(tmp_path, 2, [(layout, micro, True)], "dtypes=float64", scope="micro_batch")
    got = results[(*key, layout, micro)]
    assert got["counts"] == reference["counts"]
    assert max_rel_diff(got, reference, keys=("grads", "weights")) <= 1e-11
    assert all(abs(a - b) <= 1e-11 * abs(b) for key in ("aux", "z") for a, b in zip(got[key], reference[key]))


# Pipeline parallelism, PP 2 with 1F1B (one MoE layer per stage, GA 4, padded and packed rows): each stage adds its
# layers' router terms to its micro-batches' backward, against the pool of both stages' layers from a forward-only
# pre-pass through the pipeline; the logged aux, z and counts are summed over the stages.
PP_RUNS = [((1, 1, 1, "pp2-1f1b"), 2, False), ((1, 1, 1, "pp2-1f1b"), 2, True)]


@pytest.mark.slow
def test_pipeline_parallel_moe_matches_one_process(tmp_path, three_step_reference):
    assert_three_steps_equivalent(_launch_three_steps(tmp_path, 2, PP_RUNS), PP_RUNS, three_step_reference)


@pytest.mark.slow
def test_router_pool_of_one_stage_fails(tmp_path, three_step_reference):
    """The control: each stage's pool holds only its own layers' loads (not summed over the stages)."""
    runs = PP_RUNS[1:]
    diff = three_step_differences(_launch_three_steps(tmp_path, 2, runs, "pool_per_stage"), *runs[0],
                                  three_step_reference)
    assert diff["fp32"] > 1000 * RTOL and diff["fp64"] > 1000 * RTOL, diff


@pytest.mark.slow
def test_router_loads_not_summed_over_cp_fail(tmp_path, three_step_reference):
    """The control: each CP rank's pool holds only its pieces' tokens; the aux loss's gradient is then another."""
    runs = CP_RUNS[:1]
    diff = three_step_differences(_launch_three_steps(tmp_path, 2, runs, "loads_over_dp_only"), *runs[0],
                                  three_step_reference)
    assert diff["fp32"] > 1000 * RTOL and diff["fp64"] > 1000 * RTOL, diff
