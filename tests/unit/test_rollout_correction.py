"""Rollout correction (`ember/algorithms/rollout_correction.py`, `ember/config/rollout_correction.py`):
each weight and rejection mode against hand-computed cases, every output against verl's own
computation (ported in `verl_rollout_corr_reference.py`) on random tensors, the keys as verl
scripts write them, and the weights reaching the policy loss."""

import math

import pytest
import torch
import verl_rollout_corr_reference as verl

from ember.algorithms import (
    BypassCorrection,
    ClipConfig,
    PolicyLossInputs,
    compute_mismatch_metrics,
    compute_reinforce_policy_loss,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    get_policy_loss_fn,
)
from ember.config import ConfigError, check_implemented, load_config
from ember.config.rollout_correction import parse_rejection
from ember.config.schema.algorithm import ROLLOUT_CORRECTION_PRESETS

KEY = "algorithm.rollout_correction"
LN2 = math.log(2.0)
# two sequences: [log 2, -log 2, 0] and [log 4, padding, padding]
LOG_RATIO = torch.tensor([[LN2, -LN2, 0.0], [2 * LN2, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def assert_values(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-6)


def test_token_weights_are_the_ratios_truncated_at_the_threshold():
    weights, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, "token", threshold=3.0)
    assert_values(weights, [[2.0, 0.5, 1.0], [3.0, 0.0, 0.0]])  # 4 truncated to 3
    assert metrics["rollout_is_max"] == pytest.approx(4.0)  # measured before truncation
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 4)
    assert metrics["rollout_is_ratio_fraction_low"] == 0.0  # 0.5 is not below 1/3


def test_sequence_weight_is_the_product_of_the_token_ratios_on_every_token():
    weights, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, "sequence", threshold=2.0)
    assert_values(weights, [[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])  # 2·½·1 = 1; 4 truncated to 2
    assert metrics["rollout_is_max"] == pytest.approx(4.0)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)


def test_batch_normalisation_makes_the_mean_weight_one():
    token, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, "token", threshold=3.0, batch_normalize=True)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(6.5 / 4)  # (2 + 0.5 + 1 + 3) / 4 tokens
    assert_values(token, [[2 / 1.625, 0.5 / 1.625, 1 / 1.625], [3 / 1.625, 0.0, 0.0]])
    sequence, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, "sequence", threshold=2.0, batch_normalize=True)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(1.5)  # mean over sequences, not tokens
    assert_values(sequence, [[1 / 1.5] * 3, [2 / 1.5, 0.0, 0.0]])


@pytest.mark.parametrize("level, threshold", [("token", 3.0), ("sequence", 2.5)])
def test_with_several_ranks_the_batch_normalisation_is_over_every_ranks_micro_batch(level, threshold):
    """Bypass mode normalises each micro-batch's weights inside the update, where every data-parallel rank holds
    its own: the mean is over all of them (verl's distributed_masked_mean), so each rank's weights are the whole
    batch's, cut in two."""
    generator = torch.Generator().manual_seed(4)
    log_ratio = torch.randn(6, 5, generator=generator) * 0.5
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 1, 3, 5]).unsqueeze(1)).float()
    whole, _ = compute_rollout_is_weights(log_ratio, mask, level, threshold, batch_normalize=True)
    sent = []

    def totals_of(rows):  # what a rank puts into the all-reduce
        compute_rollout_is_weights(log_ratio[rows], mask[rows], level, threshold, batch_normalize=True,
                                   sum_over_ranks=lambda totals: sent.append(totals) or totals)
        return sent[-1]

    halves = (slice(0, 3), slice(3, 6))
    summed = totals_of(halves[0]) + totals_of(halves[1])
    for rows in halves:
        weights, metrics = compute_rollout_is_weights(log_ratio[rows], mask[rows], level, threshold,
                                                      batch_normalize=True, sum_over_ranks=lambda totals: summed)
        torch.testing.assert_close(weights, whole[rows])
        alone, _ = compute_rollout_is_weights(log_ratio[rows], mask[rows], level, threshold, batch_normalize=True)
        assert not torch.allclose(alone, whole[rows])  # this rank's own mean would be another
    bypass = BypassCorrection(loss_type="reinforce", rollout_is=level, rollout_is_threshold=threshold,
                              rollout_is_batch_normalize=True, rejection=None)
    correction = bypass.measure(log_ratio[halves[0]], torch.zeros(3, 5), mask[halves[0]],
                                sum_over_ranks=lambda totals: summed)
    torch.testing.assert_close(correction.weights, whole[halves[0]])


def test_a_catastrophic_token_gives_a_finite_truncated_weight():
    log_ratio = torch.tensor([[200.0, -200.0]])
    weights, metrics = compute_rollout_is_weights(log_ratio, torch.ones(1, 2), "token", threshold=2.0)
    assert_values(weights, [[2.0, math.exp(-20)]])
    assert metrics["rollout_is_max"] == pytest.approx(math.exp(20))


def reject(option_spec: str, threshold):
    mask, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, parse_rejection(option_spec, threshold))
    return mask.tolist(), metrics


def test_token_k1_keeps_ratios_within_the_range():
    # k1 = -log r: [-log 2, log 2, 0] and [-log 4]; range [1/3, 3] keeps |k1| <= log 3
    assert reject("token_k1", 3.0)[0] == [[1, 1, 1], [0, 0, 0]]
    assert reject("token_k1", "0.6_3.0")[0] == [[0, 1, 1], [0, 0, 0]]  # -log 2 < log 0.6


def test_token_k2_and_k3_take_an_upper_bound():
    # k2 = ½ (log r)²: 0.240, 0.240, 0 | 0.961;  k3 = r - 1 - log r: 0.307, 0.193, 0 | 1.614
    assert reject("token_k2", 0.5)[0] == [[1, 1, 1], [0, 0, 0]]
    assert reject("token_k3", 0.25)[0] == [[0, 1, 1], [0, 0, 0]]


def test_sequence_options_reject_whole_sequences():
    # k1 sums: 0 | -log 4; means 0 | -log 4; k2 max: 0.240 | 0.961
    assert reject("seq_sum_k1", "0.5_2.0")[0] == [[1, 1, 1], [0, 0, 0]]  # -log 4 < log 0.5
    assert reject("seq_sum_k1", "0.2_2.0")[0] == [[1, 1, 1], [1, 0, 0]]  # -log 4 >= log 0.2
    assert reject("seq_mean_k1", "0.5_2.0")[0] == [[1, 1, 1], [0, 0, 0]]
    assert reject("seq_max_k2", 0.5)[0] == [[1, 1, 1], [0, 0, 0]]
    assert reject("seq_max_k2", 0.2)[0] == [[0, 0, 0], [0, 0, 0]]  # one bad token vetoes its sequence
    assert reject("seq_mean_k3", 0.2)[0] == [[1, 1, 1], [0, 0, 0]]  # mean (0.307 + 0.193 + 0) / 3 = 0.167


def test_every_option_must_pass_and_metrics_count_the_rejections():
    mask, metrics = reject("token_k3,seq_mean_k1", "0.25,0.5_2.0")
    assert mask == [[0, 1, 1], [0, 0, 0]]
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert metrics["rollout_rs_token_k3_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_rs_seq_mean_k1_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_rejection_grammar():
    assert parse_rejection("token_k1", 2.0) == {"token_k1": (0.5, 2.0)}
    assert parse_rejection("seq_mean_k1,seq_max_k3,seq_mean_k1", "0.9_1.1,0.05") == {
        "seq_mean_k1": (0.9, 1.1), "seq_max_k3": (None, 0.05)}
    for rollout_rs, threshold, message in [
            ("token_k4", 1.0, "unknown rollout_rs option"), ("seq_max_k1", 1.0, "unknown"),
            ("token_k1", None, "needs rollout_rs_threshold"), ("token_k2,token_k3", "1,2,3", "3 thresholds for 2"),
            ("token_k2", "0.5_2", "only k1 options"), ("token_k1", "0_2", "positive"), ("token_k2", "x", "x")]:
        with pytest.raises(ValueError, match=message):
            parse_rejection(rollout_rs, threshold)


RANDOM_CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
         rollout_rs_threshold=None),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True, rollout_rs="seq_sum_k1",
         rollout_rs_threshold="0.5_2.0"),
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
         rollout_rs="token_k1,token_k2,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.7_1.4,0.02,0.01,0.03"),
    dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
         rollout_rs="token_k3,seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2,seq_max_k3", rollout_rs_threshold="0.05"),
]


@pytest.mark.parametrize("case", RANDOM_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_mask_and_metrics_equal_verls_on_random_tensors(case, seed):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=generator) * 3
    rollout = old + torch.randn(6, 9, generator=generator) * 0.15
    lengths = torch.tensor([9, 1, 5, 7, 3, 8])
    mask = (torch.arange(9) < lengths.unsqueeze(1)).float()
    rejection = parse_rejection(case["rollout_rs"], case["rollout_rs_threshold"]) if case["rollout_rs"] else None
    ours = compute_rollout_correction(old, rollout, mask, rollout_is=case["rollout_is"],
                                      rollout_is_threshold=case["rollout_is_threshold"],
                                      rollout_is_batch_normalize=case["rollout_is_batch_normalize"],
                                      rejection=rejection)
    weights, verl_mask, verl_metrics = verl.rollout_correction(old, rollout, mask, **case)
    if weights is None:
        assert ours.weights is None
    else:
        torch.testing.assert_close(ours.weights, weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.response_mask, verl_mask)
    verl_metrics.update(verl.debug_metrics(old, rollout, mask))
    for key, value in verl_metrics.items():
        assert ours.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    extra = set(ours.metrics) - set(verl_metrics)
    assert extra == {"rollout_corr/log_prob_abs_diff_mean", "rollout_corr/log_prob_abs_diff_max"}
    difference = (old - rollout).abs()[mask.bool()]
    assert ours.metrics["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(difference.max().item())
    assert ours.metrics["rollout_corr/log_prob_abs_diff_mean"] == pytest.approx(difference.mean().item())


def test_mismatch_metrics_of_an_empty_mask_are_zeros_with_every_key():
    metrics = compute_mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert metrics and all(value.item() == 0.0 for value in metrics.values())
    assert metrics.keys() == compute_mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)).keys()


def test_weights_multiply_each_tokens_vanilla_policy_loss():
    base = dict(old_log_probs=torch.tensor([[-1.1, -1.9, -0.5]]), log_probs=torch.tensor([[-1.0, -2.0, -0.5]]),
                advantages=torch.tensor([[1.0, -2.0, 0.5]]), response_mask=torch.ones(1, 3))
    weights = [2.0, 0.5, 0.0]
    loss_fn = get_policy_loss_fn("vanilla")
    per_token = [loss_fn(PolicyLossInputs(**{**base, "response_mask": torch.eye(3)[position:position + 1]}),
                         ClipConfig(), loss_agg_mode="token-sum").loss.item() for position in range(3)]
    weighted = loss_fn(PolicyLossInputs(**base, rollout_is_weights=torch.tensor([weights])), ClipConfig(),
                       loss_agg_mode="token-sum")
    assert weighted.loss.item() == pytest.approx(sum(w * loss for w, loss in zip(weights, per_token)))


def test_weights_multiply_each_tokens_gspo_policy_loss():
    base = dict(old_log_probs=torch.tensor([[-1.1, -1.9, -0.5]]), log_probs=torch.tensor([[-1.0, -2.0, -0.5]]),
                advantages=torch.tensor([[1.0, 1.0, 1.0]]), response_mask=torch.ones(1, 3))
    loss_fn = get_policy_loss_fn("gspo")
    plain = loss_fn(PolicyLossInputs(**base), ClipConfig(), loss_agg_mode="token-sum").loss
    doubled = loss_fn(PolicyLossInputs(**base, rollout_is_weights=torch.full((1, 3), 2.0)), ClipConfig(),
                      loss_agg_mode="token-sum").loss
    assert doubled.item() == pytest.approx(2 * plain.item())


def test_reinforce_loss_is_minus_advantage_times_log_prob_times_weight_with_its_gradient():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    inputs = PolicyLossInputs(old_log_probs=torch.tensor([[-1.5, -2.0, -0.5]]), log_probs=log_probs,
                              advantages=torch.tensor([[1.0, -2.0, 0.5]]), response_mask=torch.tensor([[1.0, 1.0, 0.0]]),
                              rollout_is_weights=torch.tensor([[2.0, 0.5, 3.0]]))
    output = compute_reinforce_policy_loss(inputs, ClipConfig(), loss_agg_mode="token-sum")
    output.loss.backward()
    assert output.loss.item() == pytest.approx(-(1.0 * -1.0 * 2.0) - (-2.0 * -2.0 * 0.5))  # padding left out
    assert_values(log_probs.grad, [[-2.0, 1.0, 0.0]])  # d/dlogπ of −A·w·logπ
    assert output.ppo_kl.item() == pytest.approx(-0.25) and output.clipfrac.item() == 0.0


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_weights_are_current_over_rollout_and_reach_only_the_reinforce_loss(loss_type):
    rollout = torch.tensor([[-1.0, -0.5, -2.0], [-1.5, -1.0, -1.0]])
    bypass = BypassCorrection(loss_type=loss_type, rollout_is="token", rollout_is_threshold=3.0,
                              rollout_is_batch_normalize=False, rejection=parse_rejection("seq_max_k2", 0.5))
    correction = bypass.measure(rollout + LOG_RATIO, rollout, MASK)
    expected = compute_rollout_correction(rollout + LOG_RATIO, rollout, MASK, rollout_is="token", rollout_is_threshold=3.0,
                                          rollout_is_batch_normalize=False, rejection=parse_rejection("seq_max_k2", 0.5))
    assert correction.metrics == expected.metrics and torch.equal(correction.response_mask, expected.response_mask)
    assert_values(correction.response_mask, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # ½(log 4)² = 0.96 > 0.5 > ½(log 2)²
    if loss_type == "reinforce":
        assert_values(correction.weights, [[2.0, 0.5, 1.0], [3.0, 0.0, 0.0]])  # π_θ/π_rollout, truncated at 3
    else:  # the PPO ratio π_θ/π_rollout corrects already: weights would count it twice (verl)
        assert correction.weights is None


def test_verl_keys_load_with_verls_defaults():
    correction = load_config([]).algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold, correction.rollout_rs,
            correction.rollout_rs_threshold, correction.bypass_mode, correction.loss_type,
            correction.rollout_is_batch_normalize) == (None, 2.0, None, None, False, "ppo_clip", False)
    assert not correction.enabled
    cfg = load_config([f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_threshold=2.0",
                       f"{KEY}.rollout_is_batch_normalize=true", f"{KEY}.rollout_rs=null",
                       f"{KEY}.rollout_rs_threshold=null", f"{KEY}.bypass_mode=false", f"{KEY}.loss_type=ppo_clip"])
    assert cfg.algorithm.rollout_correction.enabled
    cfg = load_config([f"{KEY}.rollout_rs=token_k1,seq_mean_k3", f"{KEY}.rollout_rs_threshold='0.5_2.0,0.01'"])
    assert cfg.algorithm.rollout_correction.rollout_rs_threshold == "0.5_2.0,0.01"


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.rollout_rs=seq_mean_k1"], "needs rollout_rs_threshold"),
    ([f"{KEY}.rollout_rs=seq_mean_k9", f"{KEY}.rollout_rs_threshold=0.1"], "unknown rollout_rs option"),
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=0"], "rollout_is_threshold=0"),
    ([f"{KEY}.rollout_is=tokens"], "token, sequence"),
])
def test_invalid_settings_are_refused_at_load_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_older_verls_token_veto_is_refused_naming_its_replacement():
    load_config([f"{KEY}.rollout_token_veto_threshold=null"])  # verl's default: accepted
    with pytest.raises(ConfigError, match="rollout_rs=seq_max_k2"):
        load_config([f"{KEY}.rollout_token_veto_threshold=1e-4"])


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTION_PRESETS))
def test_every_verl_preset_loads(name):
    overrides = [f"{KEY}.{key}={'null' if value is None else value}"
                 for key, value in ROLLOUT_CORRECTION_PRESETS[name].items()]
    check_implemented(load_config(overrides))
