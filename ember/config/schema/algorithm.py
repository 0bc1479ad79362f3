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
