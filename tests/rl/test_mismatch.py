"""The rollout engine–trainer mismatch (isotrain/rl/mismatch.py): every correction and every logged figure against
numbers worked out by hand, on packed rows (two sequences in one row, a prompt token and a padding token holding
garbage), the objective's statistics and PPO ratio of `bypass`, the metrics row, and the settings refused."""

from __future__ import annotations

import math
import re
import typing

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from isotrain.config import RolloutCorrection, build_config
from isotrain.errors import ConfigError
from isotrain.rl.experience import PADDED, RolloutBatch, RowLayout, make_micro_batch, response_logprobs
from isotrain.rl.metrics import mismatch_metrics
from isotrain.rl.mismatch import CORRECTIONS, MASKING, correction_weights, logprob_gap, sequence_sums
from isotrain.rl.objective import STAT_NAMES, RLObjective
from isotrain.rl.update import UpdateTotals, recomputes_old_logprobs

NAN, INF = float("nan"), float("inf")

# Two packed rows of 7 positions. Row 0: a prompt position of sequence 0 (mask 0), sequence 0's three response
# tokens, sequence 1's two, one padding position (id 0, as make_micro_batch leaves it). Row 1: sequence 2's two
# tokens, sequence 3's four, padding. RATIOS are ρ = π_old / π_engine of the response tokens; None: masked.
RATIOS = [[None, 2.0, 0.5, 1.5, 3.0, 1.0, None],
          [0.25, 0.8, 1.2, 1.2, 1.2, 1.2, None]]
IDS = [[0, 0, 0, 0, 1, 1, 0], [2, 2, 3, 3, 3, 3, 0]]
# Sequence ratios Π ρ: seq 0: 2 · 0.5 · 1.5 = 1.5; seq 1: 3; seq 2: 0.25 · 0.8 = 0.2; seq 3: 1.2^4 = 2.0736.
# Geometric means: 1.5^(1/3) = 1.145, √3 = 1.732, √0.2 = 0.447, 1.2.


def packed_inputs():
    """(trainer, engine, mask, ids) in fp64; masked positions hold inf / NaN, which must not reach any result."""
    engine = torch.tensor([[-1.0 - 0.1 * c for c in range(7)] for _ in range(2)], dtype=torch.float64)
    trainer = engine.clone()
    mask = torch.zeros(2, 7)
    for r, row in enumerate(RATIOS):
        for c, ratio in enumerate(row):
            if ratio is None:
                trainer[r, c], engine[r, c] = INF, NAN
            else:
                trainer[r, c] += math.log(ratio)
                mask[r, c] = 1.0
    return trainer, engine, mask, torch.tensor(IDS)


def padded(values: torch.Tensor, fill) -> torch.Tensor:
    """The same four sequences one per row (their response tokens left-aligned), for the layout check."""
    spans = [(0, 1, 4), (0, 4, 6), (1, 0, 2), (1, 2, 6)]
    out = torch.full((4, 4), fill, dtype=values.dtype)
    for i, (row, start, end) in enumerate(spans):
        out[i, : end - start] = values[row, start:end]
    return out


# Expected weights, by hand from RATIOS (0 on masked positions and on dropped tokens).
EXPECTED = {
    # min(ρ, 2)
    ("token_tis", (2.0,)): [[0, 2, 0.5, 1.5, 2, 1, 0], [0.25, 0.8, 1.2, 1.2, 1.2, 1.2, 0]],
    # min(Π ρ, 2): 1.5, 2 (3 capped), 0.2, 2 (2.0736 capped)
    ("seq_tis", (2.0,)): [[0, 1.5, 1.5, 1.5, 2, 2, 0], [0.2, 0.2, 2, 2, 2, 2, 0]],
    # ρ inside [0.6, 1.6], else 0: 2, 0.5, 3 and 0.25 dropped
    ("token_mis", (0.6, 1.6)): [[0, 0, 0, 1.5, 0, 1, 0], [0, 0.8, 1.2, 1.2, 1.2, 1.2, 0]],
    # Π ρ inside [0.5, 2]: only sequence 0 (1.5); 3, 0.2 and 2.0736 dropped
    ("seq_mis", (0.5, 2.0)): [[0, 1.5, 1.5, 1.5, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
    # geometric mean inside [0.8, 1.25]: sequences 0 (1.145) and 3 (1.2) kept with weight 1
    ("geo_rs", (0.8, 1.25)): [[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0]],
}
DROPPED = {"token_tis": 0, "seq_tis": 0, "token_mis": 4, "seq_mis": 8, "geo_rs": 4}


def settings(mode: str, values: tuple) -> dict:
    return {"cap": values[0]} if len(values) == 1 else {"low": values[0], "high": values[1]}


@pytest.mark.parametrize("mode,values", list(EXPECTED), ids=[mode for mode, _ in EXPECTED])
def test_each_correction_matches_its_formula(mode, values):
    trainer, engine, mask, ids = packed_inputs()
    weights, dropped = correction_weights(mode, trainer.requires_grad_(), engine, mask, ids, **settings(mode, values))
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[(mode, values)], dtype=torch.float64),
                               atol=1e-12, rtol=0)
    assert not weights.requires_grad
    assert int(dropped.sum()) == DROPPED[mode]
    assert not (dropped & (mask == 0)).any()  # a masked position is never counted as dropped
    if mode in MASKING:  # here no kept weight underflows, so the dropped tokens are exactly the zero weights
        assert torch.equal(dropped, (weights == 0) & (mask > 0))


@pytest.mark.parametrize("mode,values", list(EXPECTED), ids=[mode for mode, _ in EXPECTED])
def test_each_correction_is_the_same_packed_or_one_sequence_per_row(mode, values):
    trainer, engine, mask, ids = packed_inputs()
    packed, _ = correction_weights(mode, trainer, engine, mask, ids, **settings(mode, values))
    alone, _ = correction_weights(mode, padded(trainer, INF), padded(engine, NAN), padded(mask, 0.0), None,
                                  **settings(mode, values))
    assert torch.equal(padded(packed, 0.0), alone)


def test_sequence_quantities_are_taken_in_log_space():
    """A sequence whose ratio product is e^1000 (inf as a product) gets the cap, not inf or NaN; a lower bound of 0
    keeps any small ratio; a sequence with no unmasked token has sum 0 and count 0."""
    trainer = torch.tensor([[500.0, 500.0, 0.0], [-400.0, -400.0, 0.0]], dtype=torch.float64)
    engine = torch.zeros_like(trainer)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    weights, _ = correction_weights("seq_tis", trainer, engine, mask, cap=2.0)
    assert weights.tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]  # e^-800 underflows to 0, never NaN
    weights, dropped = correction_weights("seq_mis", trainer, engine, mask, low=0.0, high=2.0)
    assert weights.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]] and dropped.tolist() == [
        [True, True, False], [False, False, False]]  # e^-800 is inside [0, 2]: kept, its weight underflows
    total, count = sequence_sums(trainer, torch.zeros_like(mask))
    assert total.tolist() == [[0.0] * 3] * 2 and count.tolist() == [[0.0] * 3] * 2


def test_bad_arguments_are_refused():
    trainer, engine, mask, ids = packed_inputs()
    with pytest.raises(ValueError, match="cap must be positive"):
        correction_weights("seq_tis", trainer, engine, mask, ids, cap=0.0)
    with pytest.raises(ValueError, match="0 <= low < high"):
        correction_weights("seq_mis", trainer, engine, mask, ids, low=2.0, high=0.5)
    with pytest.raises(ValueError, match="valid weighting modes"):
        correction_weights("bypass", trainer, engine, mask, ids)


def test_logprob_gap_by_hand():
    """Δ = log 2, log 0.5, 0: |Δ| = ln 2, ln 2, 0; exp|Δ| = 2, 2, 1; k3 = ρ - 1 - ln ρ = 1 - ln 2, ln 2 - 0.5, 0."""
    engine = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = engine + torch.tensor([[math.log(2.0), math.log(0.5), 0.0]])
    gap, mult, k3 = logprob_gap(trainer, engine)
    ln2 = math.log(2.0)
    torch.testing.assert_close(gap, torch.tensor([[ln2, ln2, 0.0]], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(mult, torch.tensor([[2.0, 2.0, 1.0]], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(k3, torch.tensor([[1 - ln2, ln2 - 0.5, 0.0]], dtype=torch.float64), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- the objective's statistics

# Three samples, packed by make_micro_batch into a row of sample C (3 + 5 tokens) and a row of A (2 + 3) then B
# (1 + 1) and one padding position. Per response token ρ = π_old / π_engine and each sample's advantage:
SAMPLE_RATIOS = {"A": [2.0, 0.5, 1.5], "B": [3.0], "C": [0.25, 0.5, 1.1, 1.5, 1.0]}
ADVANTAGE = {"A": 1.0, "B": -1.0, "C": 0.25}
# Σ|ln ρ|, Σ max(ρ, 1/ρ) = (2 + 2 + 1.5) + 3 + (4 + 2 + 1.1 + 1.5 + 1) = 18.1, Σ (ρ - 1 - ln ρ), over 9 tokens.
ALL = [x for name in "ABC" for x in SAMPLE_RATIOS[name]]
GAP_SUM, MULT_SUM = sum(abs(math.log(x)) for x in ALL), 18.1
K3_SUM = sum(x - 1 - math.log(x) for x in ALL)


def tiny_policy():
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=16)
    return AutoModelForCausalLM.from_config(config)


def rl_config(**rl):
    return build_config({"model": {"config": {"model_type": "llama"}},
                         "rl": {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token-mean", **rl}}, recipe="rl").rl


def objective_stats(rl, model, layout: RowLayout, with_old: bool) -> dict:
    """One loss_sum over the three samples; old = the model's own log-probs (ratio 1), engine = old - ln ρ."""
    batch = RolloutBatch([0, 1, 2], [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12, 13, 14, 15]], [[]] * 3,
                         [False] * 3, [0.0] * 3, [0.0] * 3)
    own = response_logprobs(model, batch, pad_id=0, micro_batch_size=3, temperature=1.0, device=torch.device("cpu"))
    engine = [[x - math.log(r) for x, r in zip(row, SAMPLE_RATIOS[name])] for row, name in zip(own, "ABC")]
    per_token = {"old_logprobs": own if with_old else None, "engine_logprobs": engine,
                 "advantages": [[ADVANTAGE[name]] * len(row) for row, name in zip(own, "ABC")]}
    mb = make_micro_batch(batch, 0, False, per_token, layout)
    if layout.packed:
        assert mb["input_ids"].shape == (2, 8) and (mb["sequence_ids"][1].tolist() == [0] * 5 + [1] * 2 + [0])
    stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    with torch.no_grad():
        RLObjective(rl).loss_sum(model, mb, torch.autocast("cpu", enabled=False), torch.device("cpu"), stats)
    return dict(zip(STAT_NAMES, stats.tolist()))


def assert_stats(got: dict, expected: dict) -> None:
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.parametrize("layout", [RowLayout(packed=True), PADDED], ids=["packed", "padded"])
def test_objective_logs_the_mismatch_and_weights_the_policy_term(layout):
    """seq_mis [0.5, 2]: A (Π ρ = 1.5) keeps weight 1.5 on its 3 tokens, B (3) and C (0.206) are dropped (6 tokens).
    The ratio to π_old is 1, so each token's policy loss is -A_s · w_t: Σ = -1 · 1.5 · 3 = -4.5 (unweighted: -3.25)."""
    stats = objective_stats(rl_config(rollout_correction="seq_mis", rollout_mask_low=0.5, rollout_mask_high=2.0),
                            tiny_policy(), layout, with_old=True)
    assert_stats(stats, {"tokens": 9, "pg_loss": -4.5, "clipped": 0, "rollout_logprob_diff": GAP_SUM,
                         "token_mult_prob_error": MULT_SUM, "rollout_kl": K3_SUM, "correction_weight": 4.5,
                         "correction_masked": 6})


def test_bypass_takes_the_ppo_ratio_against_the_engine():
    """No π_old recomputed (one optimizer step per rollout): the ratio is π / π_engine = ρ, clipped to [0.8, 1.2].
    pg_t = max(-A ρ, -A clamp(ρ)): A: -1.2 (clipped), -0.5, -1.2 (clipped); B: 3; C: -0.0625, -0.125, -0.275, -0.3
    (clipped), -0.25. Σ = -2.9 + 3 - 1.0125 = -0.9125, 3 clipped; no weight; the mismatch is measured as before."""
    stats = objective_stats(rl_config(rollout_correction="bypass"), tiny_policy(), RowLayout(packed=True),
                            with_old=False)
    assert_stats(stats, {"tokens": 9, "pg_loss": -0.9125, "clipped": 3, "rollout_logprob_diff": GAP_SUM,
                         "token_mult_prob_error": MULT_SUM, "rollout_kl": K3_SUM, "correction_weight": 0,
                         "correction_masked": 0})
    # Without bypass the same micro-batch has ratio 1: nothing clipped, pg = -Σ A = -(3 - 1 + 1.25).
    assert_stats(objective_stats(rl_config(), tiny_policy(), RowLayout(packed=True), with_old=False),
                 {"pg_loss": -3.25, "clipped": 0, "rollout_logprob_diff": GAP_SUM})


def test_tis_cap_is_token_level_truncated_is():
    """rl.tis_cap=2: w = min(ρ, 2) = A: 2, 0.5, 1.5; B: 2; C: 0.25, 0.5, 1.1, 1.5, 1 (Σ 10.35);
    pg = -(1 · 4) - (-1 · 2) - 0.25 · 4.35 = -3.0875."""
    stats = objective_stats(rl_config(tis_cap=2.0), tiny_policy(), RowLayout(packed=True), with_old=True)
    assert_stats(stats, {"correction_weight": 10.35, "pg_loss": -3.0875, "correction_masked": 0})


def test_metrics_row_divides_the_global_sums_once():
    totals = UpdateTotals()
    sums = {"tokens": 8.0, "rollout_logprob_diff": 2.0, "token_mult_prob_error": 10.0, "rollout_kl": 0.4,
            "correction_weight": 6.0, "correction_masked": 2.0}
    for name, value in sums.items():
        totals.stats[STAT_NAMES.index(name)] = value
    base = {"rollout_logprob_diff": 0.25, "token_mult_prob_error": 1.25, "rollout_kl": 0.05}
    assert mismatch_metrics(totals, None) == base
    assert mismatch_metrics(totals, "bypass") == base
    assert mismatch_metrics(totals, "seq_tis") == {**base, "rollout_is_weight_mean": 0.75}
    assert mismatch_metrics(totals, "geo_rs") == {**base, "rollout_is_weight_mean": 0.75, "rollout_masked_frac": 0.25}


def test_bypass_skips_the_old_logprob_forward_only_where_it_served_the_ratio():
    assert not recomputes_old_logprobs(rl_config(), 1)
    assert recomputes_old_logprobs(rl_config(), 2)
    assert not recomputes_old_logprobs(rl_config(rollout_correction="bypass"), 2)
    assert recomputes_old_logprobs(rl_config(rollout_correction="bypass", kl_coef=0.1, kl_in_reward=True), 1)


# ----------------------------------------------------------------------------- settings


def test_config_names_the_modes_of_mismatch_py():
    assert typing.get_args(RolloutCorrection) == CORRECTIONS


def test_valid_settings():
    assert (rl_config(tis_cap=1.5).correction, rl_config(tis_cap=1.5).correction_cap) == ("token_tis", 1.5)
    both = rl_config(tis_cap=1.5, rollout_correction="token_tis")
    assert (both.correction, both.correction_cap) == ("token_tis", 1.5)
    seq = rl_config(rollout_correction="seq_tis", rollout_is_cap=3.0)
    assert (seq.correction, seq.correction_cap) == ("seq_tis", 3.0)
    geo = rl_config(rollout_correction="geo_rs", rollout_mask_low=0.999, rollout_mask_high=1.001)
    assert (geo.correction, geo.rollout_mask_low, geo.rollout_mask_high) == ("geo_rs", 0.999, 1.001)
    # low 0 (no lower bound) and high 1 (only ratios below 1 kept) are the widest and narrowest valid ends
    assert rl_config(rollout_correction="token_mis", rollout_mask_low=0.0, rollout_mask_high=1.0).correction == \
        "token_mis"
    assert rl_config().correction is None


REFUSED = [
    ({"tis_cap": 2.0, "rollout_correction": "seq_tis"},
     "rl.tis_cap=2 is token-level truncated IS, which contradicts rl.rollout_correction=seq_tis; remove rl.tis_cap "
     "(set rl.rollout_is_cap for seq_tis) or rl.rollout_correction"),
    ({"tis_cap": 2.0, "rollout_correction": "bypass"},
     "rl.tis_cap=2 is token-level truncated IS, which contradicts rl.rollout_correction=bypass; remove rl.tis_cap or "
     "rl.rollout_correction"),
    ({"tis_cap": 2.0, "rollout_is_cap": 3.0},
     "rl.tis_cap=2 and rl.rollout_is_cap=3 both set the cap of token-level truncated IS; keep one of them"),
    ({"rollout_correction": "seq_tis"},
     "rl.rollout_correction=seq_tis needs rl.rollout_is_cap, the largest weight; set it, e.g. rl.rollout_is_cap=2.0"),
    ({"rollout_correction": "seq_tis", "rollout_is_cap": 0},
     "config value rl.rollout_is_cap=0 is invalid: Input should be greater than 0; use a finite number > 0, e.g. 2.0"),
    ({"tis_cap": -1},
     "config value rl.tis_cap=-1 is invalid: Input should be greater than 0; use a number > 0, e.g. 2.0, or null for "
     "no correction"),
    ({"rollout_correction": "seq_mis", "rollout_mask_low": 0.5},
     "rl.rollout_correction=seq_mis needs rl.rollout_mask_low and rl.rollout_mask_high, the range of kept ratios; set "
     "both, e.g. 0.5 and 2.0 (geo_rs: 0.999 and 1.001)"),
    ({"rollout_correction": "seq_mis", "rollout_mask_low": 2.0, "rollout_mask_high": 0.5},
     "rl.rollout_mask_low=2 is not below rl.rollout_mask_high=0.5, so no range of ratios is kept; set low < high, "
     "e.g. 0.5 and 2.0"),
    ({"rollout_correction": "token_mis", "rollout_mask_low": 1.1, "rollout_mask_high": 2.0},
     "rl.rollout_mask_low=1.1 and rl.rollout_mask_high=2 leave out the ratio 1 of an engine and trainer that agree, "
     "so the matched tokens would be dropped; choose low <= 1 <= high, e.g. 0.5 and 2.0"),
    ({"rollout_correction": "geo_rs", "rollout_mask_low": -0.5, "rollout_mask_high": 2.0},
     "config value rl.rollout_mask_low=-0.5 is invalid: Input should be greater than or equal to 0; use a finite "
     "number >= 0 and <= 1, e.g. 0.5"),
    ({"rollout_correction": "seq_tis", "rollout_is_cap": 2.0, "rollout_mask_high": 2.0},
     "rl.rollout_mask_high=2 is read only when rl.rollout_correction is token_mis, seq_mis or geo_rs, not seq_tis; "
     "remove rl.rollout_mask_high or choose one of those modes"),
    ({"rollout_is_cap": 2.0},
     "rl.rollout_is_cap=2 is read only when rl.rollout_correction is token_tis or seq_tis, not null; remove "
     "rl.rollout_is_cap or choose one of those modes"),
    ({"rollout_correction": "bypass", "rollout_mask_low": 0.5, "rollout_mask_high": 2.0},
     "rl.rollout_mask_low=0.5 is read only when rl.rollout_correction is token_mis, seq_mis or geo_rs, not bypass; "
     "remove rl.rollout_mask_low or choose one of those modes"),
]


@pytest.mark.parametrize("rl,sentence", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_settings_are_refused_with_one_sentence(rl, sentence):
    with pytest.raises(ConfigError, match=f"^{re.escape(sentence)}$"):
        rl_config(**rl)
