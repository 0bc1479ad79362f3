"""KL estimators, KL controllers, the KL penalty in the reward, and outcome scores as token rewards."""

import math

import pytest
import torch

from ember.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimator_names,
    kl_penalty,
    scores_to_token_rewards,
)

LN2 = math.log(2)


@pytest.mark.parametrize("kind, expected", [
    ("kl", LN2), ("k1", LN2), ("abs", LN2), ("mse", 0.5 * LN2 ** 2), ("k2", 0.5 * LN2 ** 2),
    ("low_var_kl", 0.5 + LN2 - 1), ("k3", 0.5 + LN2 - 1),  # exp(-ln 2) - (-ln 2) - 1
])
def test_estimators_hand_computed(kind, expected):
    log_probs, ref_log_probs = torch.tensor([0.0]), torch.tensor([-LN2])
    value = kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind=kind)
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_k1_can_be_negative_and_abs_cannot():
    log_probs, ref_log_probs = torch.tensor([-LN2]), torch.tensor([0.0])
    assert kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind="kl").item() == pytest.approx(-LN2)
    assert kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind="abs").item() == pytest.approx(LN2)


def test_k3_is_clamped_at_ten():
    assert kl_penalty(log_probs=torch.tensor([0.0]), ref_log_probs=torch.tensor([30.0]),
                      kind="low_var_kl").item() == 10.0


def test_k3_and_its_gradient_stay_finite_at_extreme_log_ratios():
    """The log-ratio is clamped to ±20 before exp: unclamped, exp(100) overflows float32 and the
    backward pass turns 0 · inf into nan even though the value is capped at 10."""
    log_probs = torch.zeros(2, requires_grad=True)
    value = kl_penalty(log_probs=log_probs, ref_log_probs=torch.tensor([100.0, -100.0]), kind="low_var_kl")
    value.sum().backward()
    assert value.tolist() == [10.0, 10.0]
    assert torch.equal(log_probs.grad, torch.zeros(2))


def test_full_kl_over_the_vocabulary_accepts_logits():
    # p = [1/2, 1/2], q = [1/4, 3/4]: KL = ½ ln 2 + ½ ln(2/3)
    logits = torch.tensor([[[1.0, 1.0]]])
    ref_logits = torch.tensor([[[0.0, math.log(3)]]])
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert kl_penalty(log_probs=logits, ref_log_probs=ref_logits, kind="full").item() == pytest.approx(
        expected, rel=1e-5)
    log_probs = torch.log_softmax(logits, -1)
    assert kl_penalty(log_probs=log_probs, ref_log_probs=torch.log_softmax(ref_logits, -1),
                      kind="full").item() == pytest.approx(expected, rel=1e-5)
    generator = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(2, 3, 5, generator=generator), torch.randn(2, 3, 5, generator=generator)
    per_token = kl_penalty(log_probs=logits, ref_log_probs=ref_logits, kind="full")  # [B, R, V] -> one KL per token
    assert per_token.shape == (2, 3)
    assert per_token[1, 2].item() == pytest.approx(
        kl_penalty(log_probs=logits[1:, 2:], ref_log_probs=ref_logits[1:, 2:], kind="full").item())


def test_every_estimator_is_zero_at_equal_inputs_and_k3_never_negative():
    generator = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(64, 32, generator=generator) * 5
    for kind in kl_estimator_names():
        same = torch.randn(4, 8, 16, generator=generator) if kind == "full" else log_probs
        assert torch.count_nonzero(kl_penalty(log_probs=same, ref_log_probs=same.clone(), kind=kind)) == 0, kind
    for scale in (1e-7, 1e-3, 1.0, 30.0):
        ref_log_probs = log_probs + torch.randn(64, 32, generator=generator) * scale
        assert (kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind="k3") >= 0).all()


@pytest.mark.parametrize("kind", ["k1+", "low_var_kl+", "k3+", "abs+"])
def test_straight_through_variants_take_the_value_of_the_estimator_and_the_gradient_of_k2(kind):
    log_probs = torch.tensor([0.3, -0.2], requires_grad=True)
    ref_log_probs = torch.tensor([-0.4, 0.1])
    value = kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind=kind)
    assert torch.allclose(value, kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind=kind[:-1]))
    value.sum().backward()
    assert torch.allclose(log_probs.grad, (log_probs - ref_log_probs).detach())


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'; valid names: abs, full, k1, k2, k3, kl, low_var_kl"):
        kl_penalty(log_probs=torch.zeros(1), ref_log_probs=torch.zeros(1), kind="k4")
    with pytest.raises(ValueError, match="Unknown KL estimator 'full\\+'"):
        kl_penalty(log_probs=torch.zeros(1, 1, 2), ref_log_probs=torch.zeros(1, 1, 2), kind="full+")


def test_adaptive_controller_follows_the_clipped_proportional_rule():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    controller.update(current_kl=1.5, n_steps=10)  # error 0.5 clipped to 0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    controller.update(current_kl=0.9, n_steps=10)  # error -0.1
    assert controller.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 10 / 100))
    fixed = FixedKLController(kl_coef=0.05)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="horizon must be positive"):
        AdaptiveKLController(0.1, 1.0, horizon=0)
    assert AdaptiveKLController(0.1, 1.0, horizon=1).horizon == 1
    with pytest.raises(ValueError, match="target_kl must be positive, got 0"):
        AdaptiveKLController(0.1, target_kl=0, horizon=100)


def test_adaptive_controller_error_is_relative_to_the_target():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    controller.update(current_kl=0.55, n_steps=10)  # error 0.55 / 0.5 - 1 = 0.1
    assert controller.value == pytest.approx(0.1 * (1 + 0.1 * 10 / 100))


def test_apply_kl_penalty_subtracts_on_valid_tokens_and_reports_mean_kl():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref_log_probs = torch.full((2, 3), -1.0)
    log_probs = torch.tensor([[-0.9, -0.9, -0.9], [-0.7, -0.7, 99.0]])  # KL 0.1 and 0.3, garbage in padding
    rewards, metrics = apply_kl_penalty(token_level_scores=scores, log_probs=log_probs, ref_log_probs=ref_log_probs,
                                        response_mask=mask, kl_coef=0.5, kind="kl")
    expected = torch.tensor([[-0.05, -0.05, 0.95], [-0.15, 0.85, 0.0]])
    assert torch.allclose(rewards, expected, atol=1e-6)
    assert metrics["kl"] == pytest.approx((0.1 + 0.3) / 2, abs=1e-6)
    assert metrics["kl_coef"] == 0.5


def test_scores_land_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1], [1, 0, 0]])
    rewards = scores_to_token_rewards([1.0, 2.0, 3.0, 4.0], mask)
    assert torch.equal(rewards, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 3.0], [4.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"Responses \[1\] have no valid token"):
        scores_to_token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"one score per response \(4\), got scores of shape \(1,\)"):
        scores_to_token_rewards([1.0], mask)


@pytest.mark.parametrize("kl", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_kl_leaves_the_adaptive_coefficient_as_it_was(kl):
    """A step whose KL is not a number (its update is skipped as unsound) must not turn the coefficient into one:
    every later step's rewards would be NaN and every checkpoint would carry it."""
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    controller.update(current_kl=kl, n_steps=10)
    assert controller.value == 0.1
    controller.update(current_kl=1.5, n_steps=10)
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
