"""Tensors of the same shape that a function could confuse are passed by name only.

Each call below is what a positional swap would look like; it must fail loudly (TypeError)
instead of computing a wrong number.
"""

import pytest
import torch

from ember.algorithms import (
    AdvantageInputs,
    ClipConfig,
    PolicyLossInputs,
    aggregate_loss,
    apply_kl_penalty,
    compute_value_loss,
    discounted_returns,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from ember.algorithms.kl import full_kl, k3_estimate
from ember.algorithms.masked import zero_padding
from ember.algorithms.policy_loss import clipped_surrogate

T = torch.ones(2, 3)


@pytest.mark.parametrize("call", [
    lambda: kl_penalty(T, T, "k3"),
    lambda: k3_estimate(T, T),
    lambda: full_kl(T, T),
    lambda: apply_kl_penalty(T, T, T, T, 0.1),
    lambda: aggregate_loss(T, T, "token-mean"),
    lambda: masked_sum(T, T),
    lambda: masked_mean(T, T),
    lambda: masked_whiten(T, T),
    lambda: zero_padding(T, T),
    lambda: discounted_returns(T, T, 1.0),
    lambda: compute_value_loss(T, T, T, T, 0.5),
    lambda: clipped_surrogate(T, T, ClipConfig()),
    lambda: AdvantageInputs(T, T),
    lambda: PolicyLossInputs(T, T, T, T),
    lambda: ClipConfig(0.2, 0.1),
], ids=["kl_penalty", "k3_estimate", "full_kl", "apply_kl_penalty", "aggregate_loss", "masked_sum", "masked_mean",
        "masked_whiten", "zero_padding", "discounted_returns", "compute_value_loss", "clipped_surrogate",
        "AdvantageInputs", "PolicyLossInputs", "ClipConfig"])
def test_positional_tensors_are_refused(call):
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_policy_loss_aggregation_arguments_are_named(name):
    inputs = PolicyLossInputs(old_log_probs=T, log_probs=T, advantages=T, response_mask=T)
    with pytest.raises(TypeError):
        get_policy_loss_fn(name)(inputs, ClipConfig(), "token-mean", 10, 2)
    assert get_policy_loss_fn(name)(inputs, ClipConfig(), loss_agg_mode="token-mean").loss.item() == -1.0
