"""Invariant 1 for RL under context parallelism (parallel.cp): the RL trainer's forwards on pieces of every row
(rl/pieces.py) give the update of one process.

The fixed rollout of rl_equivalence_worker.py (P=4 prompts × n=4 samples, packed rows of up to 15 tokens, an
empty and a truncated response), 2 optimizer steps (rl.ppo_epochs=2) with GA 2, in fp32 and fp64, for the
CP_CASES of the worker: GRPO's token-mean, seq-mean-token-mean, Dr. GRPO's seq-mean-token-sum-norm, sequence-level
masked IS of a given π_old and of the policy's own log-probs (gathered over CP), and PPO's critic. Compared with one
process: the rollout's log-probs (and the critic's values) scored under the layout, the summed loss, every gradient
of the first step, the weights after both steps, the gradient norms and every logged statistic (KL, entropy,
clipped tokens, pg loss, the mismatch sums), counts exactly; the critic's loss, statistics, gradients and weights.
fp32 within 1e-6 relative (gradients on the scale of the model's largest, as tests/train/test_equivalence.py
measures them; weights after AdamW steps in fp64 only, for the reason given there); fp64 within 1e-12, every
tensor on its own scale (measured: ≤ 6e-14).
Layouts: CP 2 Ulysses (2 KV heads split), CP 2 ring (zig-zag pieces), and DP 2 × CP 2 on 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("rl_equivalence_worker.py"))
MICRO_BATCH = 8
TOLERANCE = {"torch.float32": 1e-6, "torch.float64": 1e-12}
SCALE_FLOOR = 1e-3  # fp32 gradients, as tests/train/test_equivalence.py measures them
EXACT_STATS = ("tokens", "clipped", "correction_masked")
SINGLE = (1, 1, 1, "ulysses")
CP2 = (1, 1, 2, "ulysses")
RING_CP2 = (1, 1, 2, "ring")
DP2_CP2 = (2, 1, 2, "ulysses")


def _rel(a, b, floor: float = 1e-30) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def _tensors(got: dict, ref: dict, prefix: str, fp64: bool) -> dict[str, float]:
    """Gradients (fp32: each against its own largest entry, floored at SCALE_FLOOR of the model's largest gradient)
    and, in fp64, the weights after the steps (tests/train/test_equivalence.py says why those are fp64 only)."""
    floor = 1e-30 if fp64 else SCALE_FLOOR * max(float(t.abs().max()) for t in ref["grads"].values())
    diffs = {f"{prefix}grads.{n}": _rel(got["grads"][n], r, floor) for n, r in ref["grads"].items()}
    if fp64:
        diffs.update({f"{prefix}weights.{n}": _rel(got["weights"][n], r) for n, r in ref["weights"].items()})
    return diffs


def _flat(values: list[list[float]]) -> list[float]:
    return [x for row in values for x in row]


def differences(got: dict, ref: dict, fp64: bool) -> dict[str, float]:
    """Relative difference of every compared value (see the module docstring)."""
    from isotrain.rl.critic import CRITIC_STATS
    from isotrain.rl.objective import STAT_NAMES

    diffs = {"loss": _rel(got["loss"], ref["loss"]), "grad_norm": _rel(got["grad_norm"], ref["grad_norm"]),
             "logprobs": _rel(_flat(got["logprobs"]), _flat(ref["logprobs"]))}
    diffs.update({f"stats.{name}": _rel(got["stats"][i], ref["stats"][i]) for i, name in enumerate(STAT_NAMES)})
    diffs.update(_tensors(got, ref, "", fp64))
    if "critic" in ref:
        g, r = got["critic"], ref["critic"]
        diffs.update({"critic.loss": _rel(g["loss"], r["loss"]), "critic.values": _rel(_flat(g["values"]),
                                                                                         _flat(r["values"]))})
        diffs.update({f"critic.{name}": _rel(g["stats"][i], r["stats"][i]) for i, name in enumerate(CRITIC_STATS)})
        diffs.update(_tensors(g, r, "critic.", fp64))
    return diffs


def assert_equivalent(results: dict, reference: dict) -> None:
    from isotrain.rl.objective import STAT_NAMES

    for case, by_dtype in results.items():
        for dtype, got in by_dtype.items():
            ref = reference[case][dtype]
            assert (got["num_updates"], got["input_tokens"], got["samples"]) == \
                   (ref["num_updates"], ref["input_tokens"], ref["samples"]), case
            for name in EXACT_STATS:
                assert got["stats"][STAT_NAMES.index(name)] == ref["stats"][STAT_NAMES.index(name)], (case, name)
            diffs = differences(got, ref, dtype == "torch.float64")
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] <= TOLERANCE[dtype], \
                f"{case} {dtype}: {worst} differs by {diffs[worst]:.2e} relative (> {TOLERANCE[dtype]})"


def _launch(tmp_path, nproc: int, layouts: list[tuple], cases: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "cp.pt"
    text = ",".join("x".join(map(str, layout)) for layout in layouts)
    proc = run_forked_ranks(nproc, ["cp", str(out), text, str(MICRO_BATCH), *([",".join(cases)] if cases else [])],
                            script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    from rl_equivalence_worker import run_cp_layouts

    return run_cp_layouts([SINGLE], MICRO_BATCH)[SINGLE]


def test_reference_exercises_every_term(reference):
    """Not trivial: tokens clipped (not all), KL and entropy nonzero, seq_mis drops some sequences and keeps
    others, the critic's values move, and the aggregations give different losses."""
    from isotrain.rl.objective import STAT_NAMES

    for case, by_dtype in reference.items():
        s = dict(zip(STAT_NAMES, by_dtype["torch.float32"]["stats"].tolist()))
        assert s["kl"] > 0 and s["entropy"] > 0, case
        # (π_old the policy itself: ratio 1, nothing clipped)
        assert 0 < s["clipped"] < s["tokens"] or case == "seq-mis-policy", case
        assert by_dtype["torch.float32"]["grad_accum_steps"] == 2 and by_dtype["torch.float32"]["num_updates"] == 2
        if case.startswith("seq-mis"):
            assert 0 < s["correction_masked"] < s["tokens"], case
    losses = {case: by_dtype["torch.float64"]["loss"] for case, by_dtype in reference.items()}
    assert len({round(x, 6) for x in losses.values()}) == len(losses) - 1  # ppo-critic's policy loss is grpo's
    assert reference["ppo-critic"]["torch.float64"]["critic"]["loss"] > 0


def test_ulysses_cp2_matches_single_process(tmp_path, reference):
    assert_equivalent(_launch(tmp_path, 2, [CP2])[CP2], reference)


def test_ring_cp2_matches_single_process(tmp_path, reference):
    """Zig-zag pieces: a row's second chunk on rank 0 follows rank 1's; Dr. GRPO and the critic."""
    assert_equivalent(_launch(tmp_path, 2, [RING_CP2], ("dr-grpo", "seq-mis-policy", "ppo-critic"))[RING_CP2],
                      {case: reference[case] for case in ("dr-grpo", "seq-mis-policy", "ppo-critic")})


@pytest.mark.slow
def test_dp2_x_cp2_matches_single_process(tmp_path, reference):
    """4 ranks: DDP 2 × Ulysses CP 2, each DP rank's CP pair on its own half of every mini-batch (GA 1)."""
    cases = ("seq-mean", "seq-mis-policy")
    assert_equivalent(_launch(tmp_path, 4, [DP2_CP2], cases)[DP2_CP2], {case: reference[case] for case in cases})
