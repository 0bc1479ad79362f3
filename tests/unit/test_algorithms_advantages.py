"""Advantage estimators: hand-computed cases, group properties, masks and the registry."""

import math
import statistics

import pytest
import torch

from ember.algorithms import AdvantageInputs, advantage_names, discounted_returns, get_advantage_fn, masked_whiten
from ember.algorithms.registry import Registry


def outcome_rewards(scores, lengths, width):
    """Rewards on the last valid token and the matching mask, built with plain loops."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    return rewards, mask


def whiten_by_hand(numbers):
    mean = sum(numbers) / len(numbers)
    variance = sum((x - mean) ** 2 for x in numbers) / (len(numbers) - 1)
    return [(x - mean) / math.sqrt(variance + 1e-8) for x in numbers]


def test_registry_lists_builtin_names_and_rejects_unknown():
    assert advantage_names() == ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo"]
    with pytest.raises(ValueError, match="Unknown advantage estimator 'grpoo'.*grpo, reinforce_plus_plus"):
        get_advantage_fn("grpoo")


def test_registry_refuses_to_rebind_a_name():
    registry = Registry("thing", "register_thing")
    registry.register("a")(len)
    registry.register("a")(len)  # the same function again is harmless
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(abs)


def test_grpo_hand_computed():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 2.0, 4.0, 5.0], [3, 1, 2, 2, 3, 1], width=3)
    group_ids = ["a", "a", "a", "b", "b", "c"]
    advantages, returns = get_advantage_fn("grpo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                                   group_ids=group_ids))
    std_a = math.sqrt(((1 - 1 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased, = sqrt(1/3)
    std_b = math.sqrt(2.0)
    expected = [(2 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6),
                -1 / (std_b + 1e-6), 1 / (std_b + 1e-6),
                5.0 / (1.0 + 1e-6)]  # a group of one: mean 0, std 1
    for row, value in enumerate(expected):
        assert torch.allclose(advantages[row], value * mask[row], atol=1e-6)
    assert torch.equal(advantages, returns)


def test_grpo_without_std_is_score_minus_mean():
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 2.0], [1, 2, 2, 1], width=2)
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=torch.tensor([7, 7, 9, 9]),
                             norm_adv_by_std_in_grpo=False)
    advantages, _ = get_advantage_fn("grpo")(inputs)
    assert torch.allclose(advantages[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_grpo_group_advantages_sum_to_zero_and_equal_rewards_give_zero():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=generator).tolist()
    rewards, mask = outcome_rewards(scores, [1 + i % 4 for i in range(12)], width=4)
    group_ids = [i // 4 for i in range(12)]
    advantages, _ = get_advantage_fn("grpo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                             group_ids=group_ids))
    per_sequence = advantages[:, 0]
    for group in range(3):
        assert abs(per_sequence[group * 4:(group + 1) * 4].sum().item()) < 1e-5
    equal, mask = outcome_rewards([0.7] * 4, [1, 2, 3, 4], width=4)
    advantages, _ = get_advantage_fn("grpo")(AdvantageInputs(token_level_rewards=equal, response_mask=mask,
                                                             group_ids=["p"] * 4))
    assert torch.count_nonzero(advantages) == 0


def test_rloo_baseline_is_mean_of_the_others():
    scores = [1.0, 0.0, 0.0, 0.5, 3.0, -1.0, 2.0]
    group_ids = ["x", "x", "x", "x", "y", "y", "z"]
    rewards, mask = outcome_rewards(scores, [2, 1, 2, 2, 1, 2, 2], width=2)
    advantages, returns = get_advantage_fn("rloo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                                   group_ids=group_ids))
    for i, (score, group) in enumerate(zip(scores, group_ids)):
        others = [s for j, (s, g) in enumerate(zip(scores, group_ids)) if g == group and j != i]
        baseline = sum(others) / len(others) if others else 0.0
        assert torch.allclose(advantages[i], (score - baseline) * mask[i], atol=1e-6)
    assert advantages[0, 0].item() == pytest.approx(1.0 - 0.5 / 3)
    assert torch.equal(advantages, returns)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    scores, lengths = [1.0, 0.0, 2.0, 4.0], [2, 1, 3, 1]
    rewards, mask = outcome_rewards(scores, lengths, width=3)
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=[0, 0, 1, 1])
    advantages, _ = get_advantage_fn("reinforce_plus_plus_baseline")(inputs)
    centered = [0.5, -0.5, -1.0, 1.0]
    token_values = [value for value, length in zip(centered, lengths) for _ in range(length)]
    expected = iter(whiten_by_hand(token_values))
    for row, length in enumerate(lengths):
        for t in range(3):
            assert advantages[row, t].item() == pytest.approx(next(expected) if t < length else 0.0, abs=1e-6)


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = get_advantage_fn("gae")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                                  values=values, gamma=0.9, lam=0.8))
    # row 0: A2 = 1 - 0.1 = 0.9; A1 = (0.9*0.1 - 0.2) + 0.72*0.9 = 0.538; A0 = (0.9*0.2 - 0.5) + 0.72*0.538 = 0.06736
    # row 1 (last token is padding): A1 = 2 - 0.4 = 1.6; A0 = (0.9*0.4 - 0.3) + 0.72*1.6 = 1.212
    raw = [[0.06736, 0.538, 0.9], [1.212, 1.6]]
    assert torch.allclose(returns, torch.tensor([[0.56736, 0.738, 1.0], [1.512, 2.0, 0.0]]), atol=1e-6)
    expected = whiten_by_hand(raw[0] + raw[1])
    assert torch.allclose(advantages, torch.tensor([expected[:3], expected[3:] + [0.0]]), atol=1e-5)


def test_gae_with_unit_gamma_lambda_and_zero_values_is_return_to_go():
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 5, generator=generator)
    mask = torch.ones(3, 5)
    _, returns = get_advantage_fn("gae")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                         values=torch.zeros(3, 5)))
    for row in range(3):
        for t in range(5):
            assert returns[row, t].item() == pytest.approx(sum(rewards[row, t:].tolist()), abs=1e-5)


def test_gae_skips_masked_steps_without_breaking_the_recursion():
    rewards = torch.tensor([[0.3, 5.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.2]])
    holed = AdvantageInputs(token_level_rewards=rewards, response_mask=torch.tensor([[1.0, 0.0, 1.0]]), values=values,
                            gamma=0.9, lam=0.8)
    compact = AdvantageInputs(token_level_rewards=rewards[:, [0, 2]], response_mask=torch.ones(1, 2),
                              values=values[:, [0, 2]], gamma=0.9, lam=0.8)
    _, holed_returns = get_advantage_fn("gae")(holed)
    _, compact_returns = get_advantage_fn("gae")(compact)
    assert torch.allclose(holed_returns[:, [0, 2]], compact_returns)
    assert holed_returns[0, 1] == 0


def test_gae_requires_values():
    rewards, mask = outcome_rewards([1.0], [2], width=2)
    with pytest.raises(ValueError, match="critic values"):
        get_advantage_fn("gae")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask))


def test_reinforce_plus_plus_discounts_then_whitens():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = get_advantage_fn("reinforce_plus_plus")(AdvantageInputs(token_level_rewards=rewards,
                                                                                  response_mask=mask, gamma=0.5))
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5; row 1: G1 = 3, G0 = 1.5
    assert torch.allclose(returns, torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    expected = whiten_by_hand([1.5, 1.0, 2.0, 1.5, 3.0])
    assert torch.allclose(advantages, torch.tensor([expected[:3], expected[3:] + [0.0]]), atol=1e-5)


def test_remax_subtracts_greedy_baseline_without_whitening():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=mask, reward_baselines=torch.tensor([0.4, 1.0]))
    advantages, returns = get_advantage_fn("remax")(inputs)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    assert torch.allclose(advantages, torch.tensor([[0.6, 0.6, 0.6], [-0.5, -0.5, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        get_advantage_fn("remax")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask))


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"])
def test_values_under_the_mask_change_nothing(name):
    """Values under the mask never count; token rewards there count only for the group estimators, which sum a
    sequence's rewards unmasked as verl does (the trainer's rewards are 0 past the response; a token rejected by
    rollout correction keeps its reward for its sequence's score)."""
    generator = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rewards = torch.randn(4, 4, generator=generator)
    values = torch.randn(4, 4, generator=generator)
    noise = torch.randn(4, 4, generator=generator) * 100 * (1 - mask)
    common = dict(group_ids=[0, 0, 1, 1], reward_baselines=torch.randn(4, generator=generator), gamma=0.9, lam=0.95)
    clean = get_advantage_fn(name)(AdvantageInputs(token_level_rewards=rewards, response_mask=mask, values=values,
                                                   **common))
    group_estimator = name in ("grpo", "rloo", "reinforce_plus_plus_baseline")
    noisy = get_advantage_fn(name)(AdvantageInputs(token_level_rewards=rewards + (0 if group_estimator else noise),
                                                   response_mask=mask, values=values - noise, **common))
    for clean_tensor, noisy_tensor in zip(clean, noisy):
        assert torch.allclose(clean_tensor, noisy_tensor, atol=1e-6)
        assert torch.count_nonzero(clean_tensor * (1 - mask)) == 0


def test_group_std_matches_statistics_stdev():
    scores = [0.3, 0.9, 0.1, 0.4]
    rewards, mask = outcome_rewards(scores, [1, 1, 1, 1], width=1)
    advantages, _ = get_advantage_fn("grpo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                                                             group_ids=["g"] * 4, epsilon=0.0))
    expected = [(s - statistics.mean(scores)) / statistics.stdev(scores) for s in scores]
    assert torch.allclose(advantages[:, 0], torch.tensor(expected), atol=1e-6)


def test_whitening_equal_values_gives_zeros_and_one_token_is_refused():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(masked_whiten(torch.full((2, 3), 0.7), mask=mask), torch.zeros(2, 3))  # epsilon keeps 0 / 0 away
    with pytest.raises(ValueError, match="needs at least 2 valid response tokens in the batch, got 1; use a larger "
                                         r"batch or an estimator without whitening \(grpo, rloo, remax\)"):
        masked_whiten(torch.ones(1, 2), mask=torch.tensor([[1.0, 0.0]]))


def test_discounted_returns_of_one_token_responses_are_their_rewards():
    assert torch.equal(discounted_returns(rewards=torch.tensor([[2.0], [-1.0]]), mask=torch.ones(2, 1), gamma=0.9),
                       torch.tensor([[2.0], [-1.0]]))


def test_group_ids_must_match_batch():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], width=1)
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        get_advantage_fn("grpo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=[0, 0, 1]))
    with pytest.raises(ValueError, match="needs group_ids"):
        get_advantage_fn("rloo")(AdvantageInputs(token_level_rewards=rewards, response_mask=mask))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_rejected_last_token_keeps_its_sequences_outcome_in_the_group(estimator):
    """Rollout correction's rejection masks tokens before the advantages (verl's order): a sequence whose last
    token, the one holding its outcome reward, was rejected still scores that reward for its group (verl sums the
    token rewards unmasked); only its rejected tokens get no advantage."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rejected = mask.clone()
    rejected[0, 2] = 0.0  # sample 0's last token rejected
    fn = get_advantage_fn(estimator)
    kept, _ = fn(AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=[0, 0, 0, 0]))
    after, _ = fn(AdvantageInputs(token_level_rewards=rewards, response_mask=rejected, group_ids=[0, 0, 0, 0]))
    torch.testing.assert_close(after, kept * rejected)
    assert after[0, 0] > 0  # a rewarded sequence stays above its group's baseline
