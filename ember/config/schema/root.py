"""`EmberConfig`, the whole configuration of `ember train`, in verl's layout.

`BUILTIN_BASES` are the names a `defaults:` list may use for ember's own defaults, as verl
users write `- ppo_trainer`; each maps to the keys it changes from the schema defaults.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from ember.config.schema.actor import ActorConfig
from ember.config.schema.algorithm import AlgorithmConfig
from ember.config.schema.async_training import AsyncTrainingConfig
from ember.config.schema.base import field_, section
from ember.config.schema.critic import CriticConfig
from ember.config.schema.data import DataConfig
from ember.config.schema.model import ModelConfig
from ember.config.schema.profiler import GlobalProfilerConfig
from ember.config.schema.ref import RefConfig
from ember.config.schema.resources import RayInitConfig, RayKwargsConfig, ResourcePoolConfig, RolloutPoolConfig
from ember.config.schema.reward import CustomRewardFunctionConfig, RewardModelConfig
from ember.config.schema.rollout import RolloutConfig
from ember.config.schema.trainer import TrainerConfig
from ember.config.verl_keys import RL_VERL_KEYS, VerlKey


@dataclass
class ActorRolloutRefConfig:
    """The policy in its three roles: trained (actor), generating (rollout) and frozen (ref)."""

    hybrid_engine: bool = field_(True, "actor and rollout share the GPUs and the weights are synced in place; false: "
                                       "the rollout has GPUs of its own (top-level rollout.nnodes/n_gpus_per_node) and "
                                       "is sent the weights after each update over a process group, in buckets")
    nccl_timeout: int = field_(600, "seconds a collective (NCCL, or gloo on CPU) may wait before the run fails "
                                    "naming the role and step: a hung rank")
    model: ModelConfig = section(ModelConfig, "the policy model shared by the three roles")
    actor: ActorConfig = section(ActorConfig, "the trained policy")
    ref: RefConfig = section(RefConfig, "the frozen reference policy for the KL term")
    rollout: RolloutConfig = section(RolloutConfig, "response generation")


@dataclass
class EmberConfig:
    """Everything `ember train` needs: data, policy, critic, rewards, algorithm and the run."""

    builtin_bases: ClassVar[dict[str, dict[str, Any]]] = {
        "ppo_trainer": {},
        "ppo_megatron_trainer": {"actor_rollout_ref": {"actor": {"strategy": "megatron"}}},
        # verl's one_step_off_policy recipe (its config names; verl runs them from the recipe's own entry point)
        "one_step_off_ppo_trainer": {"async_training": {"mode": "one_step_off"},
                                     "actor_rollout_ref": {"hybrid_engine": False}},
        "one_step_off_ppo_megatron_trainer": {"async_training": {"mode": "one_step_off"},
                                              "actor_rollout_ref": {"hybrid_engine": False,
                                                                    "actor": {"strategy": "megatron"}}},
        # verl's fully_async_policy recipe (the keys its config sets that ember's loop reads)
        "fully_async_ppo_trainer": {"async_training": {"mode": "fully_async"},
                                    "actor_rollout_ref": {"hybrid_engine": False}},
        "fully_async_ppo_megatron_trainer": {"async_training": {"mode": "fully_async"},
                                             "actor_rollout_ref": {"hybrid_engine": False,
                                                                   "actor": {"strategy": "megatron"}}},
    }
    key_aliases: ClassVar[dict[str, str]] = {
        "ray_kwargs.ray_init": "ray_init",  # verl's newer spelling, and the NLA fork's
        "ray_kwargs.timeline_json_file": "ray_init.timeline_json_file",
    }
    verl_keys: ClassVar[dict[str, VerlKey]] = RL_VERL_KEYS  # verl's keys without a field here


    data: DataConfig = section(DataConfig, "prompt datasets and batch size")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "the policy: model, actor, reference, rollout")
    critic: CriticConfig = section(CriticConfig, "the value model (PPO with GAE)")
    reward_model: RewardModelConfig = section(RewardModelConfig, "model-based reward and reward scoring")
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig, "a user's reward function")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantage estimator and KL penalty")
    trainer: TrainerConfig = section(TrainerConfig, "the run: GPUs, logging, checkpoints, validation")
    resource_pool: ResourcePoolConfig = section(ResourcePoolConfig, "which GPUs each role uses")
    ray_init: RayInitConfig = section(RayInitConfig, "Ray start-up for multi-GPU runs (also written ray_kwargs.ray_init)")
    ray_kwargs: RayKwargsConfig = section(RayKwargsConfig, "the NLA fork's named resource pools (ray_kwargs.resource_pool)")
    rollout: RolloutPoolConfig = section(RolloutPoolConfig, "verl's rollout pool apart from the trainer's GPUs "
                                                            "(actor_rollout_ref.hybrid_engine=false)")
    async_training: AsyncTrainingConfig = section(AsyncTrainingConfig, "whether generation overlaps the update "
                                                                       "(verl's one_step_off_policy)")
    global_profiler: GlobalProfilerConfig = section(GlobalProfilerConfig, "torch.profiler traces of chosen steps")
