"""Filling the values a configuration implies but leaves open, right after type checking.

- `critic.enable: null` becomes whether the advantage estimator needs a critic (gae).
- `data.seed: null` (verl's default, which leaves its order unseeded) becomes 1.
- verl's deprecated global micro-batch sizes (`ppo_micro_batch_size`,
  `log_prob_micro_batch_size`, `micro_batch_size`) become the per-GPU sizes code reads.
- `optim.warmup_style` (verl's older name) is copied to `optim.lr_scheduler_type`.
- SFT `model.strategy: null` becomes megatron when `model.megatron` is given, else fsdp2.
- The NLA configurations get their own rules after these (ember/config/nla_rules.py): under
  `ember nla train` the fork's experience-counted `ppo_mini_batch_size` becomes prompts.

Values the user gave are never changed, only nulls and deprecated spellings.
"""

from __future__ import annotations

from typing import Any

from ember.config.errors import ConfigError
from ember.config.nla_rules import normalize_nla_sft, normalize_nla_train
from ember.config.parallel import data_parallel_size, world_size
from ember.config.schema import EmberConfig, SFTConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig
from ember.config.schema.optim import OptimConfig

CRITIC_ESTIMATORS = ("gae",)
DEFAULT_DATA_SEED = 1


def normalize(cfg: Any) -> None:
    """Fill implied values of `cfg` (a root configuration) in place."""
    if isinstance(cfg, EmberConfig):
        _normalize_rl(cfg)
    if isinstance(cfg, NLATrainConfig):
        normalize_nla_train(cfg)
    if isinstance(cfg, SFTConfig):
        _normalize_sft(cfg)
    if isinstance(cfg, NLASFTConfig):
        normalize_nla_sft(cfg)


def _normalize_rl(cfg: EmberConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS
    if cfg.data.seed is None:  # verl's default: an unseeded order there, a reproducible one here
        cfg.data.seed = DEFAULT_DATA_SEED
    world = world_size(cfg.trainer)
    actor_dp = data_parallel_size(world, actor.strategy, actor.megatron, actor.ulysses_sequence_parallel_size)
    critic_dp = data_parallel_size(world, cfg.critic.strategy, cfg.critic.megatron, cfg.critic.ulysses_sequence_parallel_size)
    ref = cfg.actor_rollout_ref.ref
    rollout = cfg.actor_rollout_ref.rollout
    prefix = "actor_rollout_ref"
    _per_gpu_from_global(actor, "ppo_micro_batch_size", f"{prefix}.actor", actor_dp)
    _per_gpu_from_global(ref, "log_prob_micro_batch_size", f"{prefix}.ref", actor_dp)
    _per_gpu_from_global(rollout, "log_prob_micro_batch_size", f"{prefix}.rollout", actor_dp)
    _per_gpu_from_global(cfg.critic, "ppo_micro_batch_size", "critic", critic_dp)
    _per_gpu_from_global(cfg.reward_model, "micro_batch_size", "reward_model", world)
    if cfg.critic.forward_micro_batch_size_per_gpu is None:
        cfg.critic.forward_micro_batch_size_per_gpu = cfg.critic.ppo_micro_batch_size_per_gpu
    _scheduler_from_warmup_style(actor.optim, f"{prefix}.actor.optim")
    _scheduler_from_warmup_style(cfg.critic.optim, "critic.optim")


def _normalize_sft(cfg: SFTConfig) -> None:
    if cfg.model.strategy is None:
        cfg.model.strategy = "megatron" if cfg.model.megatron is not None else "fsdp2"


def _per_gpu_from_global(section: Any, name: str, path: str, data_parallel: int) -> None:
    """Set `<name>_per_gpu` from the deprecated global `<name>` (divided over data-parallel ranks)."""
    total = getattr(section, name)
    if total is None:
        return
    per_gpu_name = f"{name}_per_gpu"
    if getattr(section, per_gpu_name) is not None:
        raise ConfigError(f"{path}.{name} and {path}.{per_gpu_name} are both set; "
                          f"{name} is deprecated, so remove it and keep {per_gpu_name}")
    if data_parallel <= 0 or total % data_parallel:
        raise ConfigError(f"{path}.{name}={total} cannot be split over {data_parallel} data-parallel ranks; "
                          f"set {path}.{per_gpu_name} instead")
    setattr(section, per_gpu_name, total // data_parallel)


def _scheduler_from_warmup_style(optim: OptimConfig, path: str) -> None:
    if optim.warmup_style is None or optim.warmup_style == optim.lr_scheduler_type:
        return
    if optim.lr_scheduler_type != OptimConfig.lr_scheduler_type:
        raise ConfigError(f"{path}.warmup_style={optim.warmup_style} contradicts {path}.lr_scheduler_type="
                          f"{optim.lr_scheduler_type}; warmup_style is deprecated, so remove it")
    optim.lr_scheduler_type = optim.warmup_style
