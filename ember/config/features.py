"""Configuration switches whose keys exist but whose code has not landed yet.

`check_implemented(cfg)` is called by every configured command before a real run (never
for `--print-config`), so a config written for verl loads, prints and validates, and only
running it says what ember cannot do yet. Each table row is (predicate, message); delete a
row in the commit that implements its feature. A command may pass its own rows (`ember nla
eval` only generates, so the training rows do not concern it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.config.errors import NotImplementedFeature
from ember.config.introspect import value_at
from ember.config.schema import EmberConfig, SFTConfig
from ember.config.schema.nla import FORK_SFT_DATASET_MODULE
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig

Row = tuple[Callable[[Any], bool], Callable[[Any], str]]


def _flag(path: str, message: str = "is not implemented yet") -> Row:
    """A row for a switch at `path` that is on, or a size there above 1."""

    def is_on(cfg: Any) -> bool:
        current = value_at(cfg, path)
        return current > 1 if type(current) is int else bool(current)

    return is_on, lambda cfg: f"{path}={_yaml_text(value_at(cfg, path))} {message}"


def _yaml_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_A = "actor_rollout_ref"

# The names registered in ember.algorithms (kept here so loading a config imports no torch;
# tests/unit/test_config_features.py checks the two lists agree).
IMPLEMENTED_ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
IMPLEMENTED_POLICY_LOSSES = ("vanilla", "gspo")

RL_UNIMPLEMENTED: list[Row] = [
    (lambda cfg: cfg.actor_rollout_ref.actor.strategy == "megatron",
     lambda cfg: f"{_A}.actor.strategy=megatron is not implemented yet; use fsdp"),
    (lambda cfg: cfg.actor_rollout_ref.ref.strategy == "megatron"
     and (cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward),
     lambda cfg: f"{_A}.ref.strategy=megatron is not implemented yet; use fsdp"),
    (lambda cfg: cfg.critic.enable and cfg.critic.strategy == "megatron",
     lambda cfg: "critic.strategy=megatron is not implemented yet; use fsdp"),
    (lambda cfg: cfg.actor_rollout_ref.rollout.name in ("vllm", "sglang"),
     lambda cfg: f"{_A}.rollout.name={cfg.actor_rollout_ref.rollout.name} is not available in ember yet; use ember (its own engine) or hf"),
    _flag(f"{_A}.rollout.tensor_model_parallel_size",
          "(one generation engine over several GPUs) is not implemented yet; use 1 (each GPU generates its share)"),
    _flag("trainer.noise_injection.enabled"),
    (lambda cfg: isinstance(cfg, NLATrainConfig),
     lambda cfg: "ember nla train: NLA's RL loop (the vector injected in the actor and in ember's engine, the "
                 "reconstructing critic and its reward) is not implemented yet"),
    _flag("reward_model.enable"),
    _flag(f"{_A}.model.enable_activation_offload"),
    _flag("critic.model.enable_activation_offload"),
    _flag(f"{_A}.model.lora_rank", "(LoRA) is not implemented yet; use 0"),
    _flag(f"{_A}.actor.ulysses_sequence_parallel_size"),
    _flag(f"{_A}.ref.ulysses_sequence_parallel_size"),
    _flag("critic.ulysses_sequence_parallel_size"),
    _flag(f"{_A}.model.use_liger"),
    _flag("trainer.rollout_data_dir"),
    _flag("trainer.validation_data_dir"),
    _flag("trainer.del_local_ckpt_after_load"),
    _flag("reward_model.launch_reward_fn_async"),
    _flag("data.custom_cls.path"),
    (lambda cfg: cfg.reward_model.reward_manager != "naive",
     lambda cfg: f"reward_model.reward_manager={cfg.reward_model.reward_manager} is not implemented yet; use naive "
                 "(ember's manager scores in worker processes with a per-call timeout)"),
    (lambda cfg: cfg.algorithm.adv_estimator not in IMPLEMENTED_ADVANTAGES,
     lambda cfg: f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} is not implemented yet; "
                 f"use one of {', '.join(IMPLEMENTED_ADVANTAGES)}"),
    (lambda cfg: cfg.actor_rollout_ref.actor.policy_loss.loss_mode not in IMPLEMENTED_POLICY_LOSSES,
     lambda cfg: f"{_A}.actor.policy_loss.loss_mode={cfg.actor_rollout_ref.actor.policy_loss.loss_mode} is not "
                 f"implemented yet; use one of {', '.join(IMPLEMENTED_POLICY_LOSSES)}"),
]

SFT_UNIMPLEMENTED: list[Row] = [
    (lambda cfg: cfg.model.strategy == "megatron", lambda cfg: "model.strategy=megatron is not implemented yet; use fsdp2"),
    _flag("model.lora_rank", "(LoRA) is not implemented yet; use 0"),
    _flag("ulysses_sequence_parallel_size"),
    _flag("model.use_liger"),
    # the fork's SFT files name its own NLA dataset class, which ember nla sft replaces
    (lambda cfg: cfg.data.custom_cls.path is not None
     and not (isinstance(cfg, NLASFTConfig) and cfg.data.custom_cls.path == FORK_SFT_DATASET_MODULE),
     lambda cfg: f"data.custom_cls.path={cfg.data.custom_cls.path} is not implemented yet"),
    (lambda cfg: isinstance(cfg, NLASFTConfig),
     lambda cfg: f"ember nla sft: NLA SFT (nla.train_mode={cfg.nla.train_mode}) is not implemented yet"),
]

NLA_EVAL_UNIMPLEMENTED: list[Row] = [
    (lambda cfg: True, lambda cfg: "ember nla eval: generating with the vector injected at the marker (ember's engine) "
                                   "is not implemented yet"),
]

NLA_EXTRACT_UNIMPLEMENTED: list[Row] = [
    (lambda cfg: cfg.dataset.input_parquet is None and cfg.dataset.name is not None,
     lambda cfg: f"dataset.name={cfg.dataset.name}: reading hub datasets is not implemented yet; save the documents "
                 "as a .parquet or .jsonl file and set dataset.input_parquet"),
    _flag("source_indices_file"),
]


def unimplemented_features(cfg: Any, rows: list[Row] | None = None) -> list[str]:
    """Messages for every switch in `cfg` that asks for something not implemented yet (`rows`: the
    command's own table; None = the table of `cfg`'s root)."""
    if rows is None:
        rows = (RL_UNIMPLEMENTED if isinstance(cfg, EmberConfig) else SFT_UNIMPLEMENTED if isinstance(cfg, SFTConfig)
                else NLA_EXTRACT_UNIMPLEMENTED if isinstance(cfg, NLAExtractConfig) else [])
    return [message(cfg) for applies, message in rows if applies(cfg)]


def check_implemented(cfg: Any, rows: list[Row] | None = None) -> None:
    """Raise NotImplementedFeature listing every unimplemented switch that `cfg` turns on."""
    messages = unimplemented_features(cfg, rows)
    if len(messages) == 1:
        raise NotImplementedFeature(messages[0])
    if messages:
        raise NotImplementedFeature("not implemented yet:\n  - " + "\n  - ".join(messages))
