"""PPO (vanilla) and GSPO policy losses: values, gradients at the clip boundaries, dual clip, masks."""

import math

import pytest
import torch

from ember.algorithms import ClipConfig, PolicyLossInputs, get_policy_loss_fn, policy_loss_names


def inputs_from_log_ratios(log_ratios, advantages):
    """One sequence in float64 with old log-probs 0, so token t's ratio is exp(log_ratios[t])."""
    log_probs = torch.tensor([log_ratios], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([advantages], dtype=torch.float64)
    return PolicyLossInputs(old_log_probs=torch.zeros_like(advantages), log_probs=log_probs, advantages=advantages,
                            response_mask=torch.ones_like(advantages))


def inputs_from_ratios(ratios, advantages):
    return inputs_from_log_ratios([math.log(r) for r in ratios], advantages)


def test_registry_names_and_unknown():
    assert policy_loss_names() == ["gspo", "vanilla"]
    with pytest.raises(ValueError, match="Unknown policy loss 'ppo'. Valid names: gspo, vanilla"):
        get_policy_loss_fn("ppo")


def test_vanilla_hand_computed_value_metrics_and_gradient():
    inputs = inputs_from_ratios([1.1, 1.3, 0.7, 0.9], [1.0, 1.0, -1.0, -1.0])
    output = get_policy_loss_fn("vanilla")(inputs, ClipConfig(clip_ratio=0.2), loss_agg_mode="token-mean")
    # per token: -1.1; max(-1.3, -1.2) = -1.2 (clipped); max(0.7, 0.8) = 0.8 (clipped); 0.9
    assert output.loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 0.9) / 4)
    assert output.clipfrac.item() == pytest.approx(0.5)
    assert output.ppo_kl.item() == pytest.approx(-(math.log(1.1) + math.log(1.3) + math.log(0.7) + math.log(0.9)) / 4)
    assert output.clipfrac_lower.item() == 0
    output.loss.backward()
    # d(-A·r)/d log π = -A·r on unclipped tokens, 0 where the clip is active
    assert torch.allclose(inputs.log_probs.grad, torch.tensor([[-1.1 / 4, 0.0, 0.0, 0.9 / 4]], dtype=torch.float64))
    assert not output.clipfrac.requires_grad and not output.ppo_kl.requires_grad


@pytest.mark.parametrize("advantage, ratio_offset, clipped", [
    (1.0, -1e-3, False), (1.0, 0.0, False), (1.0, 1e-3, True),  # upper bound blocks increasing a good token
    (-1.0, 1e-3, False), (-1.0, 0.0, False), (-1.0, -1e-3, True),  # lower bound blocks decreasing a bad token
])
def test_vanilla_gradient_vanishes_only_beyond_the_blocking_bound(advantage, ratio_offset, clipped):
    clip = ClipConfig(clip_ratio=0.2)
    bound = 1.2 if advantage > 0 else 0.8
    log_ratio = math.log(bound + ratio_offset)
    ratio = torch.exp(torch.tensor(log_ratio, dtype=torch.float64)).item()  # exactly as the loss computes it
    if ratio_offset == 0.0:
        # put the bound exactly on the ratio: 1 ± (r - 1) == r in float64 for r in [0.5, 2]
        exact = ratio - 1 if advantage > 0 else 1 - ratio
        clip = ClipConfig(clip_ratio_high=exact, clip_ratio_low=exact)
    inputs = inputs_from_log_ratios([log_ratio], [advantage])
    output = get_policy_loss_fn("vanilla")(inputs, clip, loss_agg_mode="token-mean")
    output.loss.backward()
    assert output.loss.item() == pytest.approx(-advantage * (ratio if not clipped else bound))
    assert output.clipfrac.item() == (1.0 if clipped else 0.0)
    assert inputs.log_probs.grad.item() == pytest.approx(0.0 if clipped else -advantage * ratio)


def test_vanilla_does_not_clip_the_direction_that_reduces_the_objective():
    # A > 0 with a small ratio and A < 0 with a large ratio keep their gradient
    inputs = inputs_from_ratios([0.5, 1.5], [1.0, -1.0])
    output = get_policy_loss_fn("vanilla")(inputs, ClipConfig(), loss_agg_mode="token-mean")
    output.loss.backward()
    assert output.clipfrac.item() == 0
    assert torch.allclose(inputs.log_probs.grad, torch.tensor([[-0.5 / 2, 1.5 / 2]], dtype=torch.float64))


def test_clip_higher_is_asymmetric():
    clip = ClipConfig(clip_ratio=0.2, clip_ratio_high=0.28)
    output = get_policy_loss_fn("vanilla")(inputs_from_ratios([1.25, 1.3, 0.75], [1.0, 1.0, -1.0]), clip,
                                           loss_agg_mode="token-mean")
    assert output.loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert output.clipfrac.item() == pytest.approx(2 / 3)


def test_dual_clip_caps_negative_advantage_loss():
    inputs = inputs_from_ratios([10.0, 2.0, 10.0], [-2.0, -2.0, 2.0])
    output = get_policy_loss_fn("vanilla")(inputs, ClipConfig(clip_ratio_c=3.0), loss_agg_mode="seq-mean-token-sum")
    # token 0: max(20, 2.4) = 20 capped to 3·2 = 6; token 1: max(4, 2.4) = 4 < 6; token 2: max(-20, -2.4) = -2.4
    assert output.loss.item() == pytest.approx(6.0 + 4.0 - 2.4)
    assert output.clipfrac_lower.item() == pytest.approx(1 / 3)
    output.loss.backward()
    assert torch.allclose(inputs.log_probs.grad, torch.tensor([[0.0, 4.0, 0.0]], dtype=torch.float64))


def test_vanilla_clamps_extreme_log_ratios_so_loss_gradient_and_ppo_kl_stay_finite():
    """Log-ratios beyond ±LOG_RATIO_LIMIT (20), e.g. from a stale old log-prob, count as at the limit:
    unclamped, exp(100) overflows float32 and the backward pass turns 0 · inf into nan."""
    log_probs = torch.tensor([[100.0, -30.0, 0.1]], requires_grad=True)  # float32, as training computes them
    advantages = torch.tensor([[-1.0, 1.0, 1.0]])
    inputs = PolicyLossInputs(old_log_probs=torch.zeros(1, 3), log_probs=log_probs, advantages=advantages,
                              response_mask=torch.ones(1, 3))
    output = get_policy_loss_fn("vanilla")(inputs, ClipConfig(clip_ratio_c=3.0), loss_agg_mode="token-mean")
    output.loss.backward()
    # token 0: ratio e^20 with A < 0, capped by the dual clip at 3; token 1: -e^-20 ≈ 0; token 2: -e^0.1
    assert output.loss.item() == pytest.approx((3.0 - math.exp(0.1)) / 3, abs=1e-6)
    assert torch.isfinite(log_probs.grad).all()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 0.0, -math.exp(0.1) / 3]]), atol=1e-6, rtol=1e-6)
    assert output.ppo_kl.item() == pytest.approx(-(20.0 - 20.0 + 0.1) / 3, rel=1e-5)  # the clamped log-ratios


def test_clip_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c must be greater than 1"):
        ClipConfig(clip_ratio_c=1.0)
    assert ClipConfig(clip_ratio_c=1.5).clip_ratio_c == 1.5
    with pytest.raises(ValueError, match="clip ratios must be non-negative, got low=-0.1, high=0.2"):
        ClipConfig(clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="clip ratios must be non-negative, got low=0.2, high=-0.1"):
        ClipConfig(clip_ratio_high=-0.1)
    assert (ClipConfig(clip_ratio=0.0).low, ClipConfig(clip_ratio=0.0).high) == (0.0, 0.0)  # ratio pinned to 1
    assert (ClipConfig(clip_ratio=0.1).low, ClipConfig(clip_ratio=0.1, clip_ratio_high=0.3).high) == (0.1, 0.3)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_values_under_the_mask_change_nothing(name):
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.randn(2, 3, generator=generator) * 0.1
    new = old + torch.randn(2, 3, generator=generator) * 0.1
    advantages = torch.randn(2, 3, generator=generator)
    garbage = torch.tensor([[0.0, 0.0, 50.0], [0.0, 0.0, 0.0]])
    clip = ClipConfig()
    clean = get_policy_loss_fn(name)(PolicyLossInputs(old_log_probs=old, log_probs=new, advantages=advantages,
                                                      response_mask=mask), clip, loss_agg_mode="token-mean")
    noisy = get_policy_loss_fn(name)(PolicyLossInputs(old_log_probs=old - garbage, log_probs=new + garbage,
                                                      advantages=advantages + garbage, response_mask=mask),
                                     clip, loss_agg_mode="token-mean")
    for field in ("loss", "clipfrac", "ppo_kl", "clipfrac_lower"):
        assert torch.allclose(getattr(clean, field), getattr(noisy, field))


def test_gspo_value_and_gradient_equal_the_sequence_level_objective():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    log_probs = torch.tensor([[0.02, -0.01, 0.05], [-0.03, 0.01, 7.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    output = get_policy_loss_fn("gspo")(PolicyLossInputs(old_log_probs=old, log_probs=log_probs, advantages=advantages,
                                                         response_mask=mask), ClipConfig(clip_ratio=0.2))
    output.loss.backward()
    s0, s1 = math.exp((0.02 - 0.01 + 0.05) / 3), math.exp((-0.03 + 0.01) / 2)
    # default aggregation seq-mean-token-mean: mean over sequences of -A_i · s_i
    assert output.loss.item() == pytest.approx((-s0 + s1) / 2)
    # d/d log π_t of -A_i · exp(mean_t log-ratio) / N = -A_i · s_i / (L_i · N)
    expected = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    assert torch.allclose(log_probs.grad, expected)
    assert output.clipfrac.item() == 0 and output.clipfrac_lower.item() == 0


def test_gspo_aggregates_per_sequence_whatever_the_run_sets_as_verl_does():
    # ratio 1: each token's loss is -A. Sequence 0 (one token, A = +1) and sequence 1 (three tokens, A = -1):
    # seq-mean-token-mean gives (-1 + 1) / 2 = 0, token-mean would give (-1 + 3) / 4 = 0.5
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    inputs = PolicyLossInputs(old_log_probs=torch.zeros(2, 3), log_probs=torch.zeros(2, 3),
                              advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]), response_mask=mask)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert get_policy_loss_fn("gspo")(inputs, ClipConfig(), loss_agg_mode=mode).loss.item() == 0.0
    assert get_policy_loss_fn("vanilla")(inputs, ClipConfig(), loss_agg_mode="token-mean").loss.item() == 0.5


def test_gspo_clips_whole_sequences():
    mask = torch.ones(2, 2, dtype=torch.float64)
    # sequence 0: mean log-ratio log 1.5 (clipped for A > 0); sequence 1: ratio 1.0 (inside)
    log_probs = torch.tensor([[math.log(1.5) + 0.1, math.log(1.5) - 0.1], [0.1, -0.1]], dtype=torch.float64,
                             requires_grad=True)
    advantages = torch.ones(2, 2, dtype=torch.float64)
    inputs = PolicyLossInputs(old_log_probs=torch.zeros(2, 2, dtype=torch.float64), log_probs=log_probs,
                              advantages=advantages, response_mask=mask)
    output = get_policy_loss_fn("gspo")(inputs, ClipConfig(clip_ratio=0.2))
    output.loss.backward()
    assert output.clipfrac.item() == pytest.approx(0.5)
    assert output.loss.item() == pytest.approx((-1.2 - 1.0) / 2)
    assert torch.allclose(log_probs.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=torch.float64))
