"""Invariant 1: loss and every gradient do not depend on the layout, nor do the weights after 3 steps.

Layouts: 1 process × 1 micro-batch (reference), 1 × GA 4, 2 DDP ranks × GA 2, 2 FSDP2 ranks × GA 2,
4 ranks × GA 1 (DDP and FSDP2); both loss reductions; a fixed global batch of variable-length,
padded, partly prompt-masked sequences with one packed sample.

fp32 checks the loss of all 3 steps and every first-step gradient within 1e-6 relative. The weights
after 3 AdamW steps are compared in fp64: AdamW's first updates are ≈ lr·sign(g), so fp32 rounding
of near-zero gradient entries (a different summation order, present even between GA 1 and GA 4 in
one process) moves single weights by up to 2·lr — an optimizer sensitivity, not a layout effect.
In fp64 the same pipeline agrees far below 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import torchrun

WORKER = str(Path(__file__).with_name("equivalence_worker.py"))
RTOL = 1e-6
FP32, FP64 = str(torch.float32), str(torch.float64)


def _single(tmp_path, micro_batch: int, naive: bool = False) -> dict:
    from equivalence_worker import run

    out = tmp_path / f"single-{micro_batch}-{naive}.pt"
    run(str(out), 1, 1, micro_batch, naive=naive)
    return torch.load(out)


def _multi(tmp_path, nproc: int, layouts: list[tuple[int, int]], micro_batch: int) -> dict:
    """One torchrun launch of `nproc` processes runs every layout in turn: {(dp_replicate, dp_shard): results}."""
    out = tmp_path / f"multi-{nproc}-{micro_batch}.pt"
    proc = torchrun(nproc, [WORKER, str(out), ",".join(f"{r}x{s}" for r, s in layouts), str(micro_batch)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_diff(a: dict, b: dict, keys=("grads",)) -> float:
    """Largest relative difference over the losses of every step and the given tensor groups."""
    worst = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["losses"], b["losses"], strict=True))
    for key in keys:
        for name, ref in b[key].items():
            worst = max(worst, _rel(a[key][name], ref))
    return worst


def assert_equivalent(result: dict, reference: dict) -> None:
    for reduction in ("token", "sequence"):
        fp32, fp64 = result[(reduction, FP32)], result[(reduction, FP64)]
        assert fp32["counts"] == reference[(reduction, FP32)]["counts"]
        assert max_rel_diff(fp32, reference[(reduction, FP32)]) <= RTOL, reduction
        assert max_rel_diff(fp64, reference[(reduction, FP64)], keys=("grads", "weights")) <= RTOL, reduction


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("ref"), micro_batch=8)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, reference):
    assert_equivalent(_single(tmp_path, micro_batch=2), reference)


# The DDP and the FSDP2 layout of a world size share one launch: starting the processes (importing
# torch and transformers) costs far more than their 3 steps.
MICRO_BATCH = 2
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4)]}


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """multi(nproc): the results of every layout of that world size, launched once per module."""
    launched = {}

    def results(nproc: int) -> dict:
        if nproc not in launched:
            launched[nproc] = _multi(tmp_path_factory.mktemp(f"multi-{nproc}"), nproc, LAYOUTS[nproc], MICRO_BATCH)
        return launched[nproc]

    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,dp_replicate,dp_shard",
    [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 1, 4)],
    ids=["ddp2-ga2", "fsdp2-ga2", "ddp4-ga1", "fsdp4-ga1"],
)
def test_data_parallel_matches_single_process(multi, reference, nproc, dp_replicate, dp_shard):
    assert_equivalent(multi(nproc)[(dp_replicate, dp_shard)], reference)


def test_naive_micro_batch_mean_would_be_detected(tmp_path, reference):
    """The per-micro-batch mean differs by far more than the tolerance, so the checks above can fail."""
    naive = _single(tmp_path, micro_batch=2, naive=True)
    assert max_rel_diff(naive[("token", FP32)], reference[("token", FP32)]) > 1000 * RTOL
