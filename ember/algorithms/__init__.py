"""RL algorithms as pure functions of tensors: advantages, policy and value losses, KL, entropy,
rollout correction.

Nothing here knows about configs, engines or distribution: callers pass plain arguments or
the small records defined next to each function. Tensors are [batch, response_length] with a
`response_mask` (1 for tokens that count). Estimators and policy losses are looked up by the
names verl users know (`get_advantage_fn("grpo")`, `get_policy_loss_fn("vanilla")`);
importing this package registers the built-in ones.
"""

from ember.algorithms.advantages import (
    AdvantageInputs,
    compute_gae_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_remax_advantages,
    discounted_returns,
)
from ember.algorithms.entropy import entropy_from_logits, log_probs_from_logits
from ember.algorithms.group_advantages import (
    compute_grpo_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
)
from ember.algorithms.kl import kl_estimator_names, kl_penalty
from ember.algorithms.kl_control import AdaptiveKLController, FixedKLController, apply_kl_penalty
from ember.algorithms.loss_aggregation import LOSS_AGG_MODES, aggregate_loss, count_tokens_and_sequences
from ember.algorithms.masked import masked_mean, masked_sum, masked_whiten
from ember.algorithms.policy_loss import (
    ClipConfig,
    PolicyLossInputs,
    PolicyLossOutput,
    compute_gspo_policy_loss,
    compute_reinforce_policy_loss,
    compute_vanilla_policy_loss,
)
from ember.algorithms.rollout_correction import (
    MISMATCH_METRICS,
    MISMATCH_PREFIXES,
    BypassCorrection,
    RolloutCorrection,
    compute_mismatch_metrics,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
)
from ember.algorithms.registry import (
    advantage_names,
    get_advantage_fn,
    get_policy_loss_fn,
    policy_loss_names,
    register_advantage,
    register_policy_loss,
)
from ember.algorithms.token_rewards import scores_to_token_rewards
from ember.algorithms.value_loss import ValueLossOutput, compute_value_loss

__all__ = [
    "LOSS_AGG_MODES",
    "MISMATCH_METRICS",
    "MISMATCH_PREFIXES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "BypassCorrection",
    "ClipConfig",
    "FixedKLController",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "RolloutCorrection",
    "ValueLossOutput",
    "advantage_names",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_mismatch_metrics",
    "compute_gspo_policy_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_reinforce_policy_loss",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "compute_value_loss",
    "compute_vanilla_policy_loss",
    "count_tokens_and_sequences",
    "discounted_returns",
    "entropy_from_logits",
    "get_advantage_fn",
    "get_policy_loss_fn",
    "kl_estimator_names",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss_names",
    "register_advantage",
    "register_policy_loss",
    "scores_to_token_rewards",
]
