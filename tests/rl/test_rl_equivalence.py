"""Invariant 1 for RL: one optimizer step of run_updates is the same math whatever the layout.

For every rl.loss_agg mode (each with rl.mask_truncated off and on), the same mini-batch of a fixed
rollout (P=4 prompts × n=4 samples, variable prompt and response lengths, an empty response, a
truncated one; PPO clipping, KL in the loss, entropy bonus and truncated IS all active), and one more
case with sequence-level masked IS (rl.rollout_correction=seq_mis, some sequences dropped, per sequence
of packed rows) instead of truncated IS, gives the same loss, the same gradient of every parameter
(DTensors compared in full), the same gradient norm and the same logged token statistics (totals.stats:
tokens, pg_loss, clipped, kl, entropy and the mismatch sums of objective.STAT_NAMES) in these layouts:
    1 process × 1 micro-batch of 16 (reference), 1 process × GA 4,
    2 DDP ranks × GA 2, 2 FSDP2 ranks × GA 2, TP 2 × GA 4 (real processes, gloo).
Counts (tokens, clipped tokens, input tokens, samples) must match exactly; losses, gradients and the
other statistics within 1e-6 relative (gradients: max abs difference / max abs value per tensor), in
fp32. What remains is fp32 rounding of differently padded micro-batches, the same for every layout
with micro-batches of 4 (≤ 4.9e-7 here, already between GA 1 and GA 4 in one process): with the
model in fp64 the gradients agree to 1e-15, while the loss and statistics keep ≈ 3e-7 from the fp32
token sums in objective.py, so fp64 would not tighten the loss check and fp32 is used.

An MoE policy (tiny Qwen3-MoE) adds the router terms: its loss (aux and z-loss included), every gradient and
the logged aux / z-loss agree within 1e-6 and the routing counts exactly, for GA 2 and 4 in one process and
DDP 2 (GA 1 and 2) and FSDP2 2 (GA 2) in the same launch as the dense layouts; `micro_batch` scope,
the control, differs under GA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("rl_equivalence_worker.py"))
RTOL = 1e-6
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
EXACT_STATS = ("tokens", "clipped", "correction_masked")


def _single(tmp_path, micro_batch: int) -> dict:
    from rl_equivalence_worker import run

    out = tmp_path / f"single-{micro_batch}.pt"
    run(str(out), 1, 1, micro_batch)
    return torch.load(out)


def _joined(layouts: list[tuple[int, ...]]) -> str:
    return ",".join("x".join(map(str, layout)) for layout in layouts)


def _multi(tmp_path, layouts: list[tuple[int, ...]], micro_batch: int, moe_layouts: list[tuple[int, ...]]) -> dict:
    """One launch of 2 processes runs every layout in turn: {(dp_replicate, dp_shard[, tp]): results,
    "moe": {(dp_replicate, dp_shard, micro_batch): {scope: results}}}."""
    out = tmp_path / f"multi-{micro_batch}.pt"
    proc = run_forked_ranks(2, [str(out), _joined(layouts), str(micro_batch), _joined(moe_layouts)], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


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

    from rl_equivalence_worker import CORRECTION_CASE

    cases = {(m, masked) for m in MODES for masked in (False, True)} | {CORRECTION_CASE}
    assert set(results) == set(reference) == cases
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

    from rl_equivalence_worker import CORRECTION_CASE

    stat = {key: dict(zip(STAT_NAMES, r["stats"].tolist())) for key, r in reference.items()}
    for key, s in stat.items():
        assert 0 < s["clipped"] < s["tokens"], key
        assert s["kl"] > 0 and s["entropy"] > 0, key
        assert s["rollout_logprob_diff"] > 0 and s["token_mult_prob_error"] > s["tokens"] and s["rollout_kl"] > 0, key
        assert 0 < s["correction_weight"], key
        assert reference[key]["grad_accum_steps"] == 1 and reference[key]["num_updates"] == 1, key
    # seq_mis drops some whole sequences and keeps others; truncated IS (tis_cap) drops none.
    corrected = stat.pop(CORRECTION_CASE)
    assert 0 < corrected["correction_masked"] < corrected["tokens"]
    assert all(s["correction_masked"] == 0 for s in stat.values())
    unmasked = reference[CORRECTION_CASE[:2]]
    assert _rel(reference[CORRECTION_CASE]["loss"], unmasked["loss"]) > 1000 * RTOL
    for mode in MODES:
        assert stat[(mode, False)]["tokens"] - stat[(mode, True)]["tokens"] == MAX_NEW_TOKENS
    losses = [reference[(mode, False)]["loss"] for mode in MODES]
    assert len({round(x, 6) for x in losses}) == len(MODES)


def test_gradient_accumulation_matches_one_micro_batch(tmp_path, reference):
    assert_equivalent(_single(tmp_path, micro_batch=4), reference, grad_accum_steps=4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """DDP, FSDP2 and TP, and the MoE layouts below, share one launch: starting the processes costs far more
    than the optimizer steps."""
    return _multi(tmp_path_factory.mktemp("multi"), [(2, 1), (1, 2), (1, 1, 2)], micro_batch=4,
                  moe_layouts=MOE_MULTI)


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


# An MoE policy (tiny Qwen3-MoE, 4 experts, top-2; rl_equivalence_worker.MOE_CONFIG) adds its router terms:
# aux and z-loss over every real prompt + response token of the mini-batch (`global` scope), with coefficients
# 0.1 and 0.01 so that they dominate the routers' gradients. Layouts: (dp_replicate, dp_shard, micro_batch).
MOE_SINGLE = [(1, 1, 16), (1, 1, 8), (1, 1, 4)]  # reference, GA 2, GA 4 (pre-pass)
# DDP 2 × GA 1 (counts all-reduced), DDP 2 × GA 2, FSDP2 2 × GA 2, and TP 2 (router and experts replicated over TP;
# a 4th number is the TP degree).
MOE_MULTI = [(2, 1, 8), (2, 1, 4), (1, 2, 4), (1, 1, 16, 2)]


def _router_gradients(result: dict) -> dict:
    return {n: g for n, g in result["grads"].items() if n.endswith("mlp.gate.weight")}


@pytest.fixture(scope="module")
def moe_single():
    """Every one-process layout in this process, each with both scopes and with both coefficients 0 ("off")."""
    from rl_equivalence_worker import MOE_SECTIONS, run_layouts

    off = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    return run_layouts([], 0, MOE_SINGLE, {**MOE_SECTIONS, "off": off})["moe"]


def assert_moe_equivalent(got: dict, ref: dict, grad_accum_steps: int) -> None:
    """Loss (router terms included), every gradient, the norm and the statistics within RTOL; the logged aux and
    z-loss within RTOL; the routing counts exactly."""
    assert got["grad_accum_steps"] == grad_accum_steps
    assert got["router"].counts == ref["router"].counts
    diffs = differences(got, ref)
    diffs["aux_loss"] = _rel(got["router"].aux_loss, ref["router"].aux_loss)
    diffs["z_loss"] = _rel(got["router"].z_loss, ref["router"].z_loss)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= RTOL, f"{worst} differs by {diffs[worst]:.2e} relative (> {RTOL})"


def test_moe_reference_has_the_router_terms(moe_single):
    """One micro-batch: the aux loss is transformers' own over every real prompt + response token (padding out),
    both scopes agree, the loss is CE + 0.1·aux + 0.01·z, and the terms move the routers' gradients."""
    from rl_equivalence_worker import MOE_SECTION, hf_aux_loss

    ref = moe_single[(1, 1, 16)]
    values = ref["global"]["router"]
    assert _rel(values.aux_loss, hf_aux_loss()) <= RTOL
    assert values.z_loss > 0 and values.counts
    tokens = ref["global"]["input_tokens"]
    assert all(sum(layer) == 2 * tokens for layer in values.counts)  # top-2: every real token counted twice
    assert_moe_equivalent(ref["micro_batch"], ref["global"], grad_accum_steps=1)
    terms = MOE_SECTION["aux_loss_coef"] * values.aux_loss + MOE_SECTION["z_loss_coef"] * values.z_loss
    assert abs(ref["global"]["loss"] - ref["off"]["loss"] - terms) <= RTOL * abs(terms)
    off = _router_gradients(ref["off"])
    assert min(_rel(g, off[n]) for n, g in _router_gradients(ref["global"]).items()) > 1000 * RTOL


@pytest.mark.parametrize("layout,grad_accum_steps", [((1, 1, 8), 2), ((1, 1, 4), 4)], ids=["ga2", "ga4"])
def test_moe_gradient_accumulation_matches_one_micro_batch(moe_single, layout, grad_accum_steps):
    for scope in ("global", "off"):
        assert_moe_equivalent(moe_single[layout][scope], moe_single[(1, 1, 16)][scope], grad_accum_steps)


def test_moe_micro_batch_scope_changes_with_grad_accum(moe_single):
    """The control: per-micro-batch pools give another loss and other router gradients under GA, by far more
    than the tolerance, so the global scope's agreement above is not a property of any pooling."""
    ref, ga4 = moe_single[(1, 1, 16)]["micro_batch"], moe_single[(1, 1, 4)]["micro_batch"]
    assert _rel(ga4["router"].aux_loss, ref["router"].aux_loss) > 100 * RTOL
    assert _rel(ga4["loss"], ref["loss"]) > 100 * RTOL
    assert max(_rel(g, _router_gradients(ref)[n]) for n, g in _router_gradients(ga4).items()) > 1000 * RTOL


@pytest.mark.slow
@pytest.mark.parametrize("layout,grad_accum_steps", [((2, 1, 8), 1), ((2, 1, 4), 2), ((1, 2, 4), 2), ((1, 1, 16, 2), 1)],
                         ids=["ddp2-ga1", "ddp2-ga2", "fsdp2-ga2", "tp2-ga1"])
def test_moe_parallel_layout_matches_single_process(two_ranks, moe_single, layout, grad_accum_steps):
    """Two processes (the launch of `two_ranks`): with one micro-batch per rank the counts are all-reduced after
    the forward, with two the routing pre-pass runs first; both give the one-process update."""
    assert_moe_equivalent(two_ranks["moe"][layout]["global"], moe_single[(1, 1, 16)]["global"], grad_accum_steps)


def test_rl_metrics_average_the_router_values_of_a_rollouts_updates():
    from isotrain.moe.objective import RouterValues
    from isotrain.rl.update import UpdateTotals

    totals = UpdateTotals()
    assert totals.router_means() is None  # a dense policy logs no router fields
    for aux, z, counts in ((2.0, 1.0, [[3, 1], [2, 2]]), (4.0, 3.0, [[1, 3], [0, 4]])):
        totals.add_router(RouterValues(aux, z, counts))
        totals.num_updates += 1
    means = totals.router_means()
    assert (means.aux_loss, means.z_loss, means.counts) == (3.0, 2.0, [[4, 4], [2, 6]])
