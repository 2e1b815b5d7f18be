"""Invariant 1 for RL: one optimizer step of run_updates is the same math whatever the layout.

For every rl.loss_agg mode (each with rl.mask_truncated off and on), the same mini-batch of a fixed
rollout (P=4 prompts × n=4 samples, variable prompt and response lengths, an empty response, a
truncated one; PPO clipping, KL in the loss, entropy bonus and truncated IS all active) gives the
same loss, the same gradient of every parameter (DTensors compared in full), the same gradient
norm and the same logged token statistics (totals.stats: tokens, pg_loss, clipped, kl, entropy,
logprob_diff sums) in these layouts:
    1 process × 1 micro-batch of 16 (reference), 1 process × GA 4,
    2 DDP ranks × GA 2, 2 FSDP2 ranks × GA 2, TP 2 × GA 4 (real processes, torchrun, gloo).
Counts (tokens, clipped tokens, input tokens, samples) must match exactly; losses, gradients and the
other statistics within 1e-6 relative (gradients: max abs difference / max abs value per tensor), in
fp32. What remains is fp32 rounding of differently padded micro-batches, the same for every layout
with micro-batches of 4 (≤ 4.9e-7 here, already between GA 1 and GA 4 in one process): with the
model in fp64 the gradients agree to 1e-15, while the loss and statistics keep ≈ 3e-7 from the fp32
token sums in objective.py, so fp64 would not tighten the loss check and fp32 is used.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import torchrun

WORKER = str(Path(__file__).with_name("rl_equivalence_worker.py"))
RTOL = 1e-6
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
EXACT_STATS = ("tokens", "clipped")


def _single(tmp_path, micro_batch: int) -> dict:
    from rl_equivalence_worker import run

    out = tmp_path / f"single-{micro_batch}.pt"
    run(str(out), 1, 1, micro_batch)
    return torch.load(out)


def _multi(tmp_path, layouts: list[tuple[int, ...]], micro_batch: int) -> dict:
    """One torchrun launch of 2 processes runs every layout in turn: {(dp_replicate, dp_shard[, tp]): results}."""
    out = tmp_path / f"multi-{micro_batch}.pt"
    proc = torchrun(2, [WORKER, str(out), ",".join("x".join(map(str, layout)) for layout in layouts), str(micro_batch)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def differences(result: dict, reference: dict) -> dict[str, float]:
    """Relative difference of the loss, grad norm, each statistic and each gradient."""
    from isotrain.rl.objective import STAT_NAMES

    diffs = {"loss": _rel(result["loss"], reference["loss"]),
             "grad_norm": _rel(result["grad_norm"], reference["grad_norm"])}
    for i, name in enumerate(STAT_NAMES):
        diffs[f"stats.{name}"] = _rel(result["stats"][i], reference["stats"][i])
    assert result["grads"].keys() == reference["grads"].keys()
    for name, ref in reference["grads"].items():
        assert result["grads"][name].shape == ref.shape, name
        diffs[f"grad.{name}"] = _rel(result["grads"][name], ref)
    return diffs


def assert_equivalent(results: dict, reference: dict, grad_accum_steps: int) -> None:
    from isotrain.rl.objective import STAT_NAMES

    assert set(results) == set(reference) == {(m, masked) for m in MODES for masked in (False, True)}
    for key, ref in reference.items():
        got = results[key]
        assert got["grad_accum_steps"] == grad_accum_steps, key  # the layout really differs
        assert (got["num_updates"], got["input_tokens"], got["samples"]) == \
               (ref["num_updates"], ref["input_tokens"], ref["samples"]), key
        for name in EXACT_STATS:
            i = STAT_NAMES.index(name)
            assert got["stats"][i] == ref["stats"][i], (key, name)
        diffs = differences(got, ref)
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= RTOL, f"{key}: {worst} differs by {diffs[worst]:.2e} relative (> {RTOL})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("ref"), micro_batch=16)


def test_reference_exercises_every_term(reference):
    """The set-up is not trivial: tokens are clipped (not all), KL and entropy are nonzero, the
    truncated sample is masked only with mask_truncated, and the modes give different losses."""
    from isotrain.rl.objective import STAT_NAMES

    from rl_equivalence_worker import MAX_NEW_TOKENS

    stat = {key: dict(zip(STAT_NAMES, r["stats"].tolist())) for key, r in reference.items()}
    for key, s in stat.items():
        assert 0 < s["clipped"] < s["tokens"], key
        assert s["kl"] > 0 and s["entropy"] > 0 and s["logprob_diff"] > 0, key
        assert reference[key]["grad_accum_steps"] == 1 and reference[key]["num_updates"] == 1, key
    for mode in MODES:
        assert stat[(mode, False)]["tokens"] - stat[(mode, True)]["tokens"] == MAX_NEW_TOKENS
    losses = [reference[(mode, False)]["loss"] for mode in MODES]
    assert len({round(x, 6) for x in losses}) == len(MODES)


def test_gradient_accumulation_matches_one_micro_batch(tmp_path, reference):
    assert_equivalent(_single(tmp_path, micro_batch=4), reference, grad_accum_steps=4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """DDP, FSDP2 and TP share one launch: starting the processes costs far more than the optimizer steps."""
    return _multi(tmp_path_factory.mktemp("multi"), [(2, 1), (1, 2), (1, 1, 2)], micro_batch=4)


@pytest.mark.slow
@pytest.mark.parametrize("layout,grad_accum_steps", [((2, 1), 2), ((1, 2), 2), ((1, 1, 2), 4)],
                         ids=["ddp2-ga2", "fsdp2-ga2", "tp2-ga4"])
def test_parallel_layout_matches_single_process(two_ranks, reference, layout, grad_accum_steps):
    assert_equivalent(two_ranks[layout], reference, grad_accum_steps=grad_accum_steps)


@pytest.mark.parametrize("mode", MODES)
def test_naive_micro_batch_mean_would_be_detected(reference, mode):
    """Dividing each micro-batch by its own denominator (then averaging the micro-batch means) misses
    by far more than the tolerance (10-50 % here), so a broken normalisation could not pass above."""
    from rl_equivalence_worker import naive_mode

    naive = naive_mode(mode, micro_batch=4)
    ref = reference[(mode, False)]
    assert _rel(naive["loss"], ref["loss"]) > 1000 * RTOL
    assert max(_rel(g, ref["grads"][n]) for n, g in naive["grads"].items()) > 1000 * RTOL
