"""Every estimator and loss of isotrain.rl.algos against numbers worked out by hand, plus the
layout invariance of the loss aggregation (invariant 1)."""

import math

import pytest
import torch

from isotrain.config import RLConfig

from isotrain.rl import algos
from isotrain.rl.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    gae_advantages,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    reinforce_pp_advantages,
    token_level_returns,
    token_logprobs,
    truncated_is_weights,
    value_loss,
)

EPS = 1e-6
F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def assert_close(actual, expected, tol=1e-12):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert not torch.isnan(actual).any(), actual
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


def test_registries_hold_the_documented_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- group advantages

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_grpo_divides_by_the_unbiased_group_std():
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 1 is constant -> 0.
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert_close(group_advantages("grpo", t(REWARDS)), [[a, -a, -a, a], [0, 0, 0, 0]])
    assert_close(group_advantages("grpo", t(REWARDS), norm_std=False), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])


def test_dr_grpo_never_divides_by_the_std():
    expected = [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]
    assert_close(group_advantages("dr_grpo", t(REWARDS)), expected)
    assert_close(group_advantages("dr_grpo", t([[3.0, 1.0]])), [[1.0, -1.0]])  # std sqrt(2) is not used


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # r_0 = 1, others (0, 0, 1): 1 - 1/3 = 2/3;  r_1 = 0, others (1, 0, 1): 0 - 2/3.
    assert_close(group_advantages("rloo", t(REWARDS)), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0]])
    # r = (3, 0, 0): 3 - 0 = 3;  0 - (3 + 0)/2 = -1.5.
    assert_close(group_advantages("rloo", t([[3.0, 0.0, 0.0]])), [[3.0, -1.5, -1.5]])


def test_reinforce_pp_baseline_whitens_over_the_whole_batch():
    # centred: [[0.5, -0.5], [1, -1]]; batch mean 0, unbiased var (0.25 + 0.25 + 1 + 1) / 3 = 5/6.
    s = math.sqrt(5 / 6) + EPS
    expected = [[0.5 / s, -0.5 / s], [1 / s, -1 / s]]
    assert_close(group_advantages("reinforce_pp_baseline", t([[1.0, 0.0], [2.0, 0.0]])), expected)
    # Constant groups stay exactly 0 next to informative ones: centred [[.5,-.5,-.5,.5],[0]*4], var 1/7.
    a = 0.5 / (math.sqrt(1 / 7) + EPS)
    assert_close(group_advantages("reinforce_pp_baseline", t(REWARDS)), [[a, -a, -a, a], [0, 0, 0, 0]])


@pytest.mark.parametrize("name", algos.GROUP_ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_identical_rewards_give_exactly_zero(name, dtype):
    # 0.1 is not representable: the fp mean of equal rewards need not equal them, and /eps would blow that up.
    rewards = torch.full((3, 7), 0.1, dtype=dtype)
    advantages = group_advantages(name, rewards)
    assert advantages.dtype == dtype
    assert torch.equal(advantages, torch.zeros_like(rewards))


@pytest.mark.parametrize("name", algos.GROUP_ESTIMATORS)
def test_group_of_one_gives_zero_not_nan(name):
    assert torch.equal(group_advantages(name, t([[3.0], [5.0]])), torch.zeros(2, 1, dtype=F64))


def test_integer_rewards_give_fp32_advantages():
    out = group_advantages("dr_grpo", torch.tensor([[1, 0]]))
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, -0.5]]


def test_group_advantages_reject_bad_names_and_shapes():
    with pytest.raises(ValueError, match="'ppo'.*grpo, dr_grpo, rloo, reinforce_pp_baseline"):
        group_advantages("ppo", t(REWARDS))
    with pytest.raises(ValueError, match="token-level"):
        group_advantages("gae", t(REWARDS))
    with pytest.raises(ValueError, match=r"\[num_groups, group_size"):
        group_advantages("grpo", t([1.0, 0.0]))


# ----------------------------------------------------------------------------- masked statistics


def test_masked_mean_and_whiten():
    values, mask = t([[1.0, 2.0], [3.0, float("nan")]]), t([[1, 1], [1, 0]])
    assert_close(masked_mean(values, mask), 2.0)
    assert_close(masked_mean(values, torch.zeros_like(mask)), 0.0)
    # mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1.
    assert_close(masked_whiten(values, mask), [[-1 / (1 + EPS), 0.0], [1 / (1 + EPS), 0.0]])
    assert_close(masked_whiten(values, torch.zeros_like(mask)), [[0.0, 0.0], [0.0, 0.0]])
    assert_close(masked_whiten(values, t([[0, 1], [0, 0]])), [[0.0, 0.0], [0.0, 0.0]])  # one value: 0


# ----------------------------------------------------------------------------- token-level advantages


def test_reinforce_pp_returns_with_gamma_half():
    rewards = t([[0.0, 0.0, 1.0, 7.0], [1.0, 0.0, 2.0, 5.0], [1.0, 9.0, 0.0, 4.0], [3.0, 3.0, 3.0, 3.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]])
    expected = [
        [0.25, 0.5, 1.0, 0.0],  # the reward under the mask (7) is ignored
        [1 + 0.5 * 2.25, 0 + 0.5 * 4.5, 2 + 0.5 * 5, 5.0],  # 2.125, 2.25, 4.5, 5
        [1 + 0.5 * 2, 0.0, 0 + 0.5 * 4, 4.0],  # a masked gap (tool output) is transparent
        [0.0, 0.0, 0.0, 0.0],
    ]
    assert_close(token_level_returns(rewards, mask, gamma=0.5), expected)


def test_reinforce_pp_advantages_whiten_returns_over_unmasked_tokens():
    rewards = t([[0.0, 0.0, 1.0, 7.0], [0.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [0, 0, 0, 0]])
    returns = [0.25, 0.5, 1.0]
    mean = sum(returns) / 3
    std = math.sqrt(sum((g - mean) ** 2 for g in returns) / 2)
    whitened = [(g - mean) / (std + EPS) for g in returns]
    assert_close(reinforce_pp_advantages(rewards, mask, gamma=0.5), [whitened + [0.0], [0.0] * 4])


def test_gae_three_tokens_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = t([[0.0, 0.0, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    values = t([[0.5, 0.4, 0.6, float("nan")], [float("nan")] * 4])  # garbage where masked
    mask = t([[1, 1, 1, 0], [0, 0, 0, 0]])
    # δ2 = 1 + 0.9*0 - 0.6 = 0.4;  δ1 = 0 + 0.9*0.6 - 0.4 = 0.14;  δ0 = 0 + 0.9*0.4 - 0.5 = -0.14
    # A2 = 0.4;  A1 = 0.14 + 0.72*0.4 = 0.428;  A0 = -0.14 + 0.72*0.428 = 0.16816
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    assert_close(advantages, [[0.16816, 0.428, 0.4, 0.0], [0.0] * 4])
    assert_close(returns, [[0.66816, 0.828, 1.0, 0.0], [0.0] * 4])


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.2, 0.3, 0.4]]), t([[1, 1, 1]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(advantages, [[0.8, 0.7, 0.6]])
    assert_close(returns, [[1.0, 1.0, 1.0]])


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])  # ref - logp = (-0.5, 1.0)
    assert_close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    assert_close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    assert_close(kl_penalty(logp, ref, "k3"), [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])


def test_k3_is_never_negative_and_never_inf():
    # Tiny log-ratios in fp32 are where exp(x) - x - 1 rounds below zero.
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(10_000, generator=generator) * 1e-3
    assert (kl_penalty(logp, torch.zeros_like(logp), "k3") >= 0).all()
    extreme = kl_penalty(t([0.0, -1000.0]), t([-1000.0, 0.0]), "k3")  # log-ratio clamped to ±20
    assert_close(extreme, [math.exp(-20) + 20 - 1, math.exp(20) - 20 - 1], tol=1e-6)


def test_k3_is_bounded_by_kl_clip_and_a_bounded_token_adds_no_gradient():
    logp = torch.tensor([0.0, -30.0, -1.0], requires_grad=True)
    ref = t([0.0, 0.0, 0.0])  # the second token: the policy is e^30 times below the reference
    kl = kl_penalty(logp, ref, "k3", clip=10.0)
    assert_close(kl.detach(), [0.0, 10.0, math.exp(1.0) - 1.0 - 1])
    kl.sum().backward()
    assert logp.grad[1] == 0 and logp.grad[2] != 0
    assert float(kl_penalty(logp.detach(), ref, "k3", clip=None)[1]) > 4e8  # unbounded: e^20 - 21
    assert RLConfig().kl_clip == 10.0


def test_unknown_kl_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


# ----------------------------------------------------------------------------- policy and value losses


def test_clip_higher_is_asymmetric():
    logp, old, adv = t([[math.log(1.25)]]), t([[0.0]]), t([[1.0]])
    loss, clipped = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert_close(loss, [[-1.25]])
    assert not clipped.item()
    loss, clipped = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert_close(loss, [[-1.2]])
    assert clipped.item()
    assert clipped.dtype == torch.bool


def test_policy_loss_by_hand_with_dual_clip():
    # ratios 0.7, 0.7, 5, 2, 5 with advantages 1, -1, -1, -1, 1; clip 0.2/0.2, dual clip c = 3.
    logp = t([[math.log(0.7), math.log(0.7), math.log(5.0), math.log(2.0), math.log(5.0)]]).requires_grad_()
    old = torch.zeros_like(logp)
    adv = t([[1.0, -1.0, -1.0, -1.0, 1.0]])
    expected_loss = [[
        -0.7,  # max(-0.7, -0.8): pessimistic, unclipped
        0.8,  # max(0.7, 0.8): clipped at 1 - 0.2
        3.0,  # max(5, 1.2) = 5, then min(5, 3) = 3: dual clip
        2.0,  # max(2, 1.2) = 2 < 3: dual clip not taken
        -1.2,  # max(-5, -1.2): clipped; dual clip is for A < 0 only
    ]]
    loss, clipped = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert_close(loss.detach(), expected_loss)
    assert clipped.tolist() == [[False, True, True, False, True]]
    # Clipped tokens get no gradient, the others get -A * ratio.
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, [[-0.7, 0.0, 0.0, 2.0, 0.0]])
    without_dual, _ = policy_loss(logp.detach(), old, adv, clip_low=0.2, clip_high=0.2)
    assert without_dual[0, 2].item() == pytest.approx(5.0)


def test_policy_loss_broadcasts_sequence_advantages():
    logp, old = t([[0.0, math.log(2.0)], [0.0, 0.0]]), torch.zeros(2, 2, dtype=F64)
    loss, clipped = policy_loss(logp, old, t([[1.0], [-2.0]]), clip_low=0.2, clip_high=0.2)
    assert_close(loss, [[-1.0, -1.2], [2.0, 2.0]])
    assert clipped.tolist() == [[False, True], [False, False]]


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), 0.2, 0.2, dual_clip=1.0)


def test_value_loss_by_hand():
    values, old, returns = t([[1.0, 1.0]]), t([[0.5, 0.5]]), t([[2.0, 0.0]])
    # clamp(1.0, 0.3, 0.7) = 0.7: token 0 max(1, 1.69) -> 0.845, token 1 max(1, 0.49) -> 0.5
    assert_close(value_loss(values, old, returns, clip=0.2), [[0.845, 0.5]])
    assert_close(value_loss(values, old, returns, clip=None), [[0.5, 0.5]])


# ----------------------------------------------------------------------------- logits


def test_entropy_by_hand_and_stable():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0, 0.0]]])  # p = (1, 3, 1, 1) / 6
    p = [1 / 6, 3 / 6, 1 / 6, 1 / 6]
    expected = [[math.log(4.0), -sum(q * math.log(q) for q in p)]]
    assert_close(entropy_from_logits(logits), expected, tol=1e-6)
    huge = entropy_from_logits(torch.tensor([[[1e4, 1e4]]], dtype=torch.bfloat16))
    assert huge.dtype == torch.float32
    assert_close(huge, [[math.log(2.0)]], tol=1e-6)


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    ids = torch.tensor([[1, 0]])
    assert_close(token_logprobs(logits, ids), [[math.log(0.75), math.log(0.25)]], tol=1e-6)
    # temperature 2: logits (0, ln3 / 2) -> p_0 = 1 / (1 + sqrt 3)
    assert_close(token_logprobs(logits, ids, temperature=2.0)[0, 1], -math.log(1 + math.sqrt(3)), tol=1e-6)
    assert token_logprobs(logits.bfloat16(), ids).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=0.0)


def test_truncated_is_weights():
    trainer = t([[math.log(0.5), math.log(3.0), math.log(1.2), float("nan")]]).requires_grad_()
    engine = t([[0.0, 0.0, 0.0, 0.0]])
    weights = truncated_is_weights(trainer, engine, t([[1, 1, 1, 0]]), cap=2.0)
    assert_close(weights, [[0.5, 2.0, 1.2, 0.0]])
    assert not weights.requires_grad
    far = truncated_is_weights(t([[500.0]]), t([[-500.0]]), t([[1]]), cap=2.0)
    assert far.item() == 2.0


# ----------------------------------------------------------------------------- aggregation

NAN = float("nan")


@pytest.mark.parametrize(
    "mode, norm_length, expected_loss, expected_denominator",
    [
        ("token-mean", None, (1 + 2 + 4) / 3, 3.0),
        ("seq-mean-token-sum", None, ((1 + 2) + 4) / 2, 2.0),
        ("seq-mean-token-mean", None, ((1 + 2) / 2 + 4) / 2, 2.0),
        ("seq-mean-token-sum-norm", 4, ((1 + 2) + 4) / (2 * 4), 8.0),
    ],
)
def test_aggregate_by_hand(mode, norm_length, expected_loss, expected_denominator):
    loss = t([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])  # garbage where masked
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    weights, denominator = aggregation_weights(mask, mode, norm_length)
    assert denominator == expected_denominator
    assert torch.equal(weights[2], torch.zeros(3, dtype=F64))  # an all-masked row contributes 0
    assert_close(aggregate(loss, mask, mode, norm_length), expected_loss)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_batch_gives_zero_loss_and_denominator(mode):
    mask = torch.zeros(2, 3, dtype=F64)
    weights, denominator = aggregation_weights(mask, mode, norm_length=8)
    assert denominator == 0.0 and torch.equal(weights, mask)
    assert aggregate(t([[NAN] * 3] * 2), mask, mode, norm_length=8).item() == 0.0


def test_aggregation_rejects_bad_modes():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="'mean'.*" + ".*".join(LOSS_AGG_MODES)):
        aggregation_weights(mask, "mean")
    with pytest.raises(ValueError, match="norm_length"):
        aggregation_weights(mask, "seq-mean-token-sum-norm")


def _random_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(8, 6, generator=generator) < 0.6).to(F64)
    mask[3] = 0  # an all-masked row
    mask[5] = 1  # a full row
    loss = torch.randn(8, 6, generator=generator, dtype=F64)
    return loss, mask


def _reference(loss, mask, mode, norm_length):
    """The definition of each mode, row by row, independent of aggregation_weights."""
    rows = [(loss[b][mask[b] > 0].tolist()) for b in range(loss.shape[0])]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / (len(nonempty) * norm_length)


def _split_loss(loss, mask, mode, norm_length, rows_per_part):
    """What micro-batches / ranks compute: Σ_parts Σ w ℓ / Σ_parts D (D all-reduced before dividing)."""
    numerator, denominator = 0.0, 0.0
    for start in range(0, loss.shape[0], rows_per_part):
        part_loss, part_mask = loss[start : start + rows_per_part], mask[start : start + rows_per_part]
        weights, part_denominator = aggregation_weights(part_mask, mode, norm_length)
        numerator = numerator + (weights * part_loss).sum()
        denominator += part_denominator
    return numerator / denominator


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_is_the_same_for_every_split(mode):
    loss, mask = _random_batch()
    loss.requires_grad_()
    norm_length = 6
    whole = aggregate(loss, mask, mode, norm_length)
    assert whole.item() == pytest.approx(_reference(loss.detach(), mask, mode, norm_length), abs=1e-12)
    (whole_grad,) = torch.autograd.grad(whole, loss)
    assert torch.equal(whole_grad[3], torch.zeros(6, dtype=F64))
    for rows_per_part in (1, 2, 4, 8):
        split = _split_loss(loss, mask, mode, norm_length, rows_per_part)
        assert_close(split.detach(), whole.detach())
        (split_grad,) = torch.autograd.grad(split, loss)
        assert_close(split_grad, whole_grad)


def test_mean_of_per_part_means_is_layout_dependent():
    # The failure the invariance test guards against: averaging each part's own token mean
    # weights a token by 1 / (its part's token count), so 2 parts and 4 parts disagree.
    loss, mask = _random_batch()
    whole = aggregate(loss, mask, "token-mean").item()
    for rows_per_part in (2, 4):
        starts = range(0, 8, rows_per_part)
        parts = [aggregate(loss[s : s + rows_per_part], mask[s : s + rows_per_part], "token-mean") for s in starts]
        assert abs(torch.stack(parts).mean().item() - whole) > 1e-3


# ----------------------------------------------------------------------------- reward shaping


def test_overlong_penalty_at_the_boundaries():
    # max_length 20, buffer 4: the ramp starts after 16 tokens and reaches -1 at 20.
    lengths = torch.tensor([0, 16, 17, 18, 20, 21, 100])
    penalty = overlong_penalty(lengths, max_length=20, buffer=4)
    assert penalty.dtype == torch.float32
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    for buffer in (0, 21):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(lengths, max_length=20, buffer=buffer)
