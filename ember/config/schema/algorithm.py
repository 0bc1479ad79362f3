"""The RL algorithm (`algorithm`): advantage estimator, discounting and the KL penalty in the reward.

Estimator and KL names are verl's; each maps to a registered function in
`ember/algorithms` (`register_advantage`, the KL estimators in `kl.py`).
"""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_, section

AdvantageEstimator = Literal[
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "opo", "gpg",
]
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]


@dataclass
class KLControlConfig:
    """Coefficient of the KL penalty subtracted from the token rewards."""

    type: Literal["fixed", "adaptive"] = field_("fixed", "fixed keeps kl_coef; adaptive steers it towards target_kl")
    kl_coef: float = field_(0.001, "initial weight of the KL penalty in the reward")
    horizon: int = field_(10000, "steps over which the adaptive controller reacts")
    target_kl: float = field_(0.1, "KL the adaptive controller aims for")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop prompt groups whose samples all scored alike, generate more."""

    enable: bool = field_(False, "keep only groups whose metric varies; generate data.gen_batch_size prompts per round "
                                 "until data.train_batch_size prompts are kept")
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] | None = field_(
        None, "per-sample number whose spread within a group decides (acc: the reward function's acc, else its "
              "score; score/seq_reward: the reward; seq_final_reward: the reward after the in-reward KL); "
              "required when enable")
    max_num_gen_batches: int = field_(
        0, "generation rounds per step before the run stops with an error; 0 = no limit, except that rounds in a "
           "row keeping no group stop the run after 10 steps' worth of groups")


RolloutISLevel = Literal["token", "sequence"]


@dataclass
class RolloutCorrectionConfig:
    """verl's rollout correction: importance weights and rejection for the gap between the
    engine's log-probs (π_rollout) and the trainer's (π_old); `ember/algorithms/rollout_correction.py`."""

    rollout_is: RolloutISLevel | None = field_(
        None, "importance weights π_old/π_rollout per token or per sequence (their product), truncated at "
              "rollout_is_threshold; null = none")
    rollout_is_threshold: float = field_(2.0, "upper bound the importance weights are truncated to (typical 2-5)")
    rollout_rs: str | None = field_(
        None, "rejection: comma-separated options that must all pass (token_k1/k2/k3, seq_sum_k1/k2/k3, "
              "seq_mean_k1/k2/k3, seq_max_k2/k3); rejected tokens or sequences leave the loss; null = none")
    rollout_rs_threshold: float | str | None = field_(
        None, "rejection thresholds, one shared or one per option (comma-separated): k1 options a ratio range "
              "'lower_upper' (a single u means 1/u_u), the others an upper bound of the divergence")
    bypass_mode: bool = field_(
        False, "true: use the rollout's log-probs as the old log-probs (two policies, no old log-prob forward); "
               "false: decoupled (old log-probs computed, weights π_old/π_rollout)")
    loss_type: Literal["ppo_clip", "reinforce"] = field_(
        "ppo_clip", "bypass mode's loss: PPO clip on π/π_rollout, or REINFORCE with explicit importance weights")
    rollout_is_batch_normalize: bool = field_(False, "rescale the truncated weights to mean 1 over the batch")

    @property
    def enabled(self) -> bool:
        """Whether weights or rejection change the loss (metrics are logged either way)."""
        return self.rollout_is is not None or self.rollout_rs is not None


# verl's RolloutCorrectionConfig presets (classmethods there), as the keys each one sets.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, object]] = {
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                                rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001"),
    "bypass_ppo_clip": dict(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip"),
    "bypass_ppo_clip_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                                   bypass_mode=True, loss_type="ppo_clip"),
    "bypass_ppo_clip_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01,
                                  bypass_mode=True, loss_type="ppo_clip"),
    "bypass_pg_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None, bypass_mode=True,
                         loss_type="reinforce"),
    "bypass_pg_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001",
                             bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001", bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001", bypass_mode=True, loss_type="reinforce"),
    "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                    rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                      rollout_rs_threshold=0.01),
    "disabled": dict(rollout_is=None, rollout_rs=None),
}


@dataclass
class AlgorithmConfig:
    """How rewards become advantages."""

    gamma: float = field_(1.0, "discount factor of GAE and REINFORCE++")
    lam: float = field_(1.0, "GAE λ: trade-off between bias (0) and variance (1)")
    adv_estimator: AdvantageEstimator = field_(
        "gae", "advantage estimator; gae needs a critic, the others compare responses")
    norm_adv_by_std_in_grpo: bool = field_(
        True, "divide GRPO advantages by the group's standard deviation (false = Dr. GRPO)")
    use_kl_in_reward: bool = field_(False, "subtract a KL(actor ‖ reference) penalty from the token rewards")
    kl_penalty: KLPenalty = field_("kl", "KL estimator of the in-reward penalty")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "coefficient of the in-reward KL penalty")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO's dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "training–inference mismatch: importance weights, rejection (metrics always logged)")
