"""Invariant 1: loss and every gradient do not depend on the layout, nor do the weights after 3 steps.

Layouts: 1 process × 1 micro-batch (reference), 1 × GA 4, DDP, FSDP2, tensor parallel (TP) and their
combinations (FSDP2 × TP, DDP × TP, HSDP) on 2 and 4 processes, with activation checkpointing, and TP on
every model family isotrain claims a plan for; both loss reductions; a fixed global batch of
variable-length, padded, partly prompt-masked sequences with one packed sample (two documents).

fp32 checks the loss of all 3 steps and every first-step gradient within 1e-6 relative. The weights
after 3 AdamW steps are compared in fp64: AdamW's first updates are ≈ lr·sign(g), so fp32 rounding
of near-zero gradient entries (a different summation order, present even between GA 1 and GA 4 in
one process) moves single weights by up to 2·lr — an optimizer sensitivity, not a layout effect.
In fp64 the same pipeline agrees far below 1e-6 (TP included: ~1e-13), for every tensor on its own scale,
which is what proves that no reduction is missing.

In fp32 a tensor's error is measured against its own largest entry, floored at 1e-3 of the model's largest
gradient. Reordered fp32 sums (TP splits every matmul's inner sum over ranks) leave an error proportional
to the size of the summed terms, i.e. to the model's gradient scale; a gradient that is itself a thousand
times smaller (Qwen2's k_proj bias, nearly cancelled by the softmax) would otherwise show that absolute
rounding as a large relative error. A missing reduction is an error of the size of the tensor itself and
fails both checks by orders of magnitude (see test_missing_tp_reduction_fails_loudly).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("equivalence_worker.py"))
RTOL = 1e-6
SCALE_FLOOR = 1e-3  # fp32 only: a tensor's scale is at least this fraction of the model's largest gradient
FP32, FP64 = str(torch.float32), str(torch.float64)


def _single(tmp_path, micro_batch: int, naive: bool = False, checkpointing: bool = False,
            family: str = "llama", packed: bool = False) -> dict:
    from equivalence_worker import run

    out = tmp_path / f"single-{micro_batch}-{naive}-{checkpointing}-{family}-{packed}.pt"
    run(str(out), micro_batch, naive=naive, checkpointing=checkpointing, family=family, packed=packed)
    return torch.load(out)


def _multi(tmp_path, nproc: int, layouts: list[tuple[int, int, int]], micro_batch: int, *flags: str) -> dict:
    """One launch of `nproc` processes runs every layout in turn: {layout: results}."""
    out = tmp_path / f"multi-{nproc}-{micro_batch}-{'-'.join(flags)}.pt"
    proc = run_forked_ranks(nproc, [str(out), ",".join(_layout_text(lay) for lay in layouts), str(micro_batch),
                            *flags], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _layout_text(layout: tuple) -> str:
    """(1, 1, 1, 1, 2) -> '1x1x1x1x2'; a ring-attention layout (1, 1, 1, 1, 2, 'ring') -> '1x1x1x1x2:ring'."""
    if layout[-1] == "ring":
        return _layout_text(layout[:-1]) + ":ring"
    return "x".join(map(str, layout))


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def max_rel_diff(a: dict, b: dict, keys=("grads",), scale_floor: float = 0.0) -> float:
    """Largest relative difference over the losses of every step and the given tensor groups."""
    worst = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["losses"], b["losses"], strict=True))
    for key in keys:
        floor = scale_floor * max(float(t.abs().max()) for t in b[key].values()) or 1e-30
        for name, ref in b[key].items():
            worst = max(worst, _rel(a[key][name], ref, floor))
    return worst


def assert_equivalent(result: dict, reference: dict) -> None:
    for reduction in ("token", "sequence"):
        fp32, fp64 = result[(reduction, FP32)], result[(reduction, FP64)]
        assert fp32["counts"] == reference[(reduction, FP32)]["counts"]
        assert max_rel_diff(fp32, reference[(reduction, FP32)], scale_floor=SCALE_FLOOR) <= RTOL, reduction
        assert max_rel_diff(fp64, reference[(reduction, FP64)], keys=("grads", "weights")) <= RTOL, reduction


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("ref"), micro_batch=8)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, reference):
    assert_equivalent(_single(tmp_path, micro_batch=2), reference)


def test_activation_checkpointing_matches_one_process(tmp_path, reference):
    assert_equivalent(_single(tmp_path, micro_batch=2, checkpointing=True), reference)


# The layouts of a world size share one launch: starting the processes (importing torch and
# transformers) costs far more than their 3 steps. (dp_replicate, dp_shard, tp)
MICRO_BATCH = 2
LAYOUTS = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(4, 1, 1), (1, 4, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)],
}


# The 2-process launch also runs its DDP and FSDP2 layouts with the chunked cross-entropy
# (train.loss_chunk_tokens, 5 tokens a chunk: chunks cross rows and documents), compared with the unchunked
# single process: results[("chunked", layout)].
CHUNKED = {2: ["chunk=5"]}


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """multi(nproc): the results of every layout of that world size, launched once per module."""
    launched = {}

    def results(nproc: int) -> dict:
        if nproc not in launched:
            launched[nproc] = _multi(tmp_path_factory.mktemp(f"multi-{nproc}"), nproc, LAYOUTS[nproc], MICRO_BATCH,
                                     *CHUNKED.get(nproc, ()))
        return launched[nproc]

    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,layout",
    [(2, (2, 1, 1)), (2, (1, 2, 1)), (2, (1, 1, 2)),
     (4, (4, 1, 1)), (4, (1, 4, 1)), (4, (1, 2, 2)), (4, (2, 1, 2)), (4, (2, 2, 1))],
    ids=["ddp2-ga2", "fsdp2-ga2", "tp2-ga4", "ddp4-ga1", "fsdp4-ga1", "fsdp2xtp2-ga2", "ddp2xtp2-ga2", "hsdp2x2-ga1"],
)
def test_parallel_layout_matches_single_process(multi, reference, nproc, layout):
    assert_equivalent(multi(nproc)[layout], reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1)], ids=["ddp2-ga2", "fsdp2-ga2"])
def test_chunked_loss_layout_matches_single_process(multi, reference, layout):
    """FSDP2 runs the chunked loss inside its root's forward (the head's parameter gathered there, its gradient
    reduce-scattered with the root's); DDP sees one forward per backward."""
    assert_equivalent(multi(2)[("chunked", layout)], reference)


@pytest.mark.slow
def test_tensor_parallel_with_activation_checkpointing(tmp_path, reference):
    results = _multi(tmp_path, 2, [(1, 1, 2)], MICRO_BATCH, "ac")
    assert_equivalent(results[(1, 1, 2)], reference)


TP_FAMILIES = ["llama_tied", "qwen2", "qwen3", "mistral"]


@pytest.mark.slow
def test_tensor_parallel_on_every_family(tmp_path):
    """TP 2 against one process for each family: tied embeddings, q/k/v biases, per-head q/k norms."""
    results = _multi(tmp_path, 2, [(1, 1, 2)], MICRO_BATCH, "families=" + ",".join(TP_FAMILIES))
    for family in TP_FAMILIES:
        assert_equivalent(results[(family, (1, 1, 2))], _single(tmp_path, micro_batch=8, family=family))


@pytest.mark.slow
def test_missing_tp_reduction_fails_loudly(tmp_path):
    """Qwen3's q/k norms see only their rank's heads; without the TP sum of their gradients the replicas
    drift apart at the first update, and the run stops naming the parameter."""
    out = tmp_path / "unreduced.pt"
    proc = run_forked_ranks(2, [str(out), "1x1x2", str(MICRO_BATCH), "families=qwen3", "unreduced"], script=WORKER)
    assert proc.returncode != 0
    assert "self_attn.q_norm.weight is replicated over tensor-parallel ranks but differs between them" in proc.stderr
    assert not out.exists()


def test_naive_micro_batch_mean_would_be_detected(tmp_path, reference):
    """The per-micro-batch mean differs by far more than the tolerance, so the checks above can fail."""
    naive = _single(tmp_path, micro_batch=2, naive=True)
    assert max_rel_diff(naive[("token", FP32)], reference[("token", FP32)]) > 1000 * RTOL
