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


def _mcore_overrides(megatron) -> list[str]:
    """Keys of `override_mcore_model_config` that would change the model: `use_cache` (HF generation's KV cache,
    which the NLA fork's 30B files set false) means nothing to a training model and is accepted."""
    return sorted(set(megatron.override_mcore_model_config) - {"use_cache"})


def _megatron_rows(role: str) -> list[Row]:
    """Megatron keys of a role whose code has not landed: initial weights from a Megatron checkpoint,
    model-constructor overrides, context parallelism."""
    def megatron(cfg):
        section = value_at(cfg, role)
        return section.megatron if section.strategy == "megatron" and section.megatron is not None else None

    return [(lambda cfg: megatron(cfg) is not None and megatron(cfg).use_dist_checkpointing,
             lambda cfg: f"{role}.megatron.use_dist_checkpointing=true (initial weights from a Megatron checkpoint) is "
                         "not implemented yet; start from the HF model (ember converts it with mbridge)"),
            (lambda cfg: megatron(cfg) is not None and bool(_mcore_overrides(megatron(cfg))),
             lambda cfg: f"{role}.megatron.override_mcore_model_config="
                         f"{_mcore_overrides(megatron(cfg))} is not implemented yet; remove it "
                         "(TransformerConfig fields go in override_transformer_config)"),
            (lambda cfg: megatron(cfg) is not None and megatron(cfg).context_parallel_size > 1,
             lambda cfg: f"{role}.megatron.context_parallel_size={megatron(cfg).context_parallel_size} is not "
                         "implemented yet (each rank would need its share of every sequence and its rotary positions); "
                         "set it to 1 and scale with tensor or pipeline parallelism")]


def _megatron_offload_rows(role: str) -> list[Row]:
    """`ember sft` trains in one phase and never moves its engine off the device, so a Megatron offload
    switch there would do nothing (the RL roles offload between phases: `engine.resident()`)."""
    return [(lambda cfg, key=key: value_at(cfg, role).strategy == "megatron"
             and getattr(value_at(cfg, role).megatron, key, False),
             lambda cfg, key=key: f"{role}.megatron.{key}=true is not implemented yet in ember sft (its loop keeps "
                                  "the model on the device between steps); set it to false")
            for key in ("param_offload", "grad_offload", "optimizer_offload")]


# The names registered in ember.algorithms (kept here so loading a config imports no torch;
# tests/unit/test_config_features.py checks the two lists agree).
IMPLEMENTED_ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
IMPLEMENTED_POLICY_LOSSES = ("vanilla", "gspo")

RL_UNIMPLEMENTED: list[Row] = [
    *_megatron_rows(f"{_A}.actor"),
    *_megatron_rows(f"{_A}.ref"),
    (lambda cfg: cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.actor_rollout_ref.rollout.engine == "hf",
     lambda cfg: f"{_A}.rollout.name=hf generates with the actor's transformers module, which strategy megatron has "
                 "not: use rollout.name=ember (its weights are synced from the Megatron shards)"),
    *[(lambda cfg, applies=applies: cfg.critic.enable and applies(cfg), message)
      for applies, message in _megatron_rows("critic")],
    (lambda cfg: cfg.actor_rollout_ref.rollout.require_named_engine
     and cfg.actor_rollout_ref.rollout.engine != cfg.actor_rollout_ref.rollout.name,
     lambda cfg: f"{_A}.rollout.name={cfg.actor_rollout_ref.rollout.name} with rollout.require_named_engine=true: "
                 f"{cfg.actor_rollout_ref.rollout.name} itself is not available in ember; drop require_named_engine "
                 "to run on ember's own engine, or use ember or hf"),
    (lambda cfg: cfg.actor_rollout_ref.rollout.mode == "async" and not cfg.actor_rollout_ref.rollout.multi_turn.enable,
     lambda cfg: f"{_A}.rollout.mode=async without multi_turn.enable (a rollout server for single-turn agent loops) "
                 "is not implemented yet; use sync, or turn on multi_turn.enable for ember's tool agent loop"),
    (lambda cfg: not cfg.actor_rollout_ref.hybrid_engine and cfg.actor_rollout_ref.rollout.engine == "hf",
     lambda cfg: f"{_A}.hybrid_engine=false with {_A}.rollout.name=hf: the hf rollout generates with the actor's own "
                 "module, which a rollout pool of its own has not; use rollout.name=ember"),
    (lambda cfg: not cfg.actor_rollout_ref.hybrid_engine and cfg.trainer.noise_injection.enabled,
     lambda cfg: f"trainer.noise_injection with {_A}.hybrid_engine=false is not implemented yet (the noise is applied "
                 "where the weights are synced beside the actor); use hybrid_engine=true"),
    (lambda cfg: not cfg.actor_rollout_ref.hybrid_engine and isinstance(cfg, NLATrainConfig),
     lambda cfg: f"ember nla train with {_A}.hybrid_engine=false is not implemented yet; use hybrid_engine=true"),
    (lambda cfg: cfg.async_training.mode != "sync" and cfg.algorithm.filter_groups.enable,
     lambda cfg: f"async_training.mode={cfg.async_training.mode} with algorithm.filter_groups (DAPO's dynamic "
                 "sampling: extra rounds within a step) is not implemented yet; set async_training.mode=sync"),
    (lambda cfg: cfg.async_training.mode != "sync" and cfg.algorithm.adv_estimator == "remax",
     lambda cfg: f"async_training.mode={cfg.async_training.mode} with algorithm.adv_estimator=remax (its greedy "
                 "baseline would be generated by other weights than the samples) is not implemented yet; use grpo or "
                 "rloo"),
    (lambda cfg: cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full",
     lambda cfg: "algorithm.kl_penalty=full (the exact KL over the vocabulary needs each token's whole distribution, "
                 "which the rollout's and reference's log-probs are not; verl raises for it too) is not implemented; "
                 "use low_var_kl, k1, k2 or abs"),
    (lambda cfg: cfg.actor_rollout_ref.actor.use_kl_loss and cfg.actor_rollout_ref.actor.kl_loss_type == "full",
     lambda cfg: f"{_A}.actor.kl_loss_type=full (the exact KL over the vocabulary needs each token's whole "
                 "distribution, which the actor's log-probs are not; verl raises for it too) is not implemented; use "
                 "low_var_kl, k1, k2 or abs"),
    (lambda cfg: any(section is not None and section.fsdp_size not in (-1, 0)
                     for section in (cfg.actor_rollout_ref.actor.fsdp_config, cfg.actor_rollout_ref.ref.fsdp_config,
                                     cfg.critic.model.fsdp_config)),
     lambda cfg: "fsdp_config.fsdp_size (hybrid sharding, HSDP) is not implemented yet; use -1 (every rank of the "
                 "role's pool shards the model)"),
    _flag("async_training.partial_rollout", "(a generation interrupted at a weight sync and continued with the new "
                                            "weights) is not implemented yet: a generation finishes with the weights "
                                            "it started with; set it false"),
    (lambda cfg: "://" in (cfg.trainer.default_hdfs_dir or ""),
     lambda cfg: f"trainer.default_hdfs_dir={cfg.trainer.default_hdfs_dir}: copying checkpoints to remote storage "
                 "(hdfs://, s3://, ...) is not implemented yet; give a local or mounted folder (each checkpoint is "
                 "copied there) or null"),
    (lambda cfg: cfg.actor_rollout_ref.rollout.tensor_model_parallel_size > 1
     and cfg.actor_rollout_ref.rollout.engine == "hf",
     lambda cfg: f"{_A}.rollout.tensor_model_parallel_size={cfg.actor_rollout_ref.rollout.tensor_model_parallel_size} "
                 f"with {_A}.rollout.name=hf: the hf rollout generates with the actor's own module on each GPU; use "
                 "rollout.name=ember (its engine splits over the GPUs) or 1"),
    (lambda cfg: cfg.trainer.noise_injection.enabled and cfg.actor_rollout_ref.rollout.engine == "hf",
     lambda cfg: f"trainer.noise_injection with {_A}.rollout.name=hf: the hf rollout generates with the actor's own "
                 "module, so noise would land on the trained weights; use rollout.name=ember (noise goes to its "
                 "copy only)"),
    (lambda cfg: isinstance(cfg, NLATrainConfig) and cfg.algorithm.adv_estimator == "remax",
     lambda cfg: "ember nla train with algorithm.adv_estimator=remax (a greedy explanation's reconstruction as the "
                 "baseline) is not implemented yet; use grpo (the fork's), rloo or reinforce_plus_plus"),
    (lambda cfg: isinstance(cfg, NLATrainConfig) and cfg.algorithm.filter_groups.enable,
     lambda cfg: "ember nla train with algorithm.filter_groups (DAPO's dynamic sampling) is not implemented yet; "
                 "set algorithm.filter_groups.enable=false"),
    (lambda cfg: isinstance(cfg, NLATrainConfig) and cfg.nla.injection.mode == "project",
     lambda cfg: "nla.injection.mode=project (a learned map of the vector) is not implemented yet; use replace or add"),
    (lambda cfg: isinstance(cfg, NLATrainConfig) and cfg.reward_model.launch_reward_fn_async,
     lambda cfg: "ember nla train with reward_model.launch_reward_fn_async=true: NLA's reward is the critic's "
                 "reconstruction, computed on the GPU with the step; set it false"),
    (lambda cfg: isinstance(cfg, NLATrainConfig) and cfg.actor_rollout_ref.rollout.engine == "hf",
     lambda cfg: f"ember nla train with {_A}.rollout.name=hf: the hf rollout cannot inject the vector; use "
                 "nla_sglang or ember (ember's engine injects it in prefill)"),
    _flag("reward_model.enable"),
    _flag(f"{_A}.model.enable_activation_offload"),
    _flag("critic.model.enable_activation_offload"),
    _flag(f"{_A}.actor.ulysses_sequence_parallel_size"),
    _flag(f"{_A}.ref.ulysses_sequence_parallel_size"),
    _flag("critic.ulysses_sequence_parallel_size"),
    _flag("data.custom_cls.path"),
    (lambda cfg: cfg.algorithm.adv_estimator not in IMPLEMENTED_ADVANTAGES,
     lambda cfg: f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} is not implemented yet; "
                 f"use one of {', '.join(IMPLEMENTED_ADVANTAGES)}"),
    (lambda cfg: cfg.actor_rollout_ref.actor.policy_loss.loss_mode not in IMPLEMENTED_POLICY_LOSSES,
     lambda cfg: f"{_A}.actor.policy_loss.loss_mode={cfg.actor_rollout_ref.actor.policy_loss.loss_mode} is not "
                 f"implemented yet; use one of {', '.join(IMPLEMENTED_POLICY_LOSSES)}"),
]

SFT_UNIMPLEMENTED: list[Row] = [
    *_megatron_rows("model"),
    *_megatron_offload_rows("model"),
    _flag("ulysses_sequence_parallel_size"),
    # the fork's SFT files name its own NLA dataset class, which ember nla sft replaces
    (lambda cfg: cfg.data.custom_cls.path is not None
     and not (isinstance(cfg, NLASFTConfig) and cfg.data.custom_cls.path == FORK_SFT_DATASET_MODULE),
     lambda cfg: f"data.custom_cls.path={cfg.data.custom_cls.path} is not implemented yet"),
    (lambda cfg: isinstance(cfg, NLASFTConfig) and (cfg.model.strategy == "megatron" or (
        cfg.model.strategy is None and cfg.model.megatron is not None)),
     lambda cfg: "ember nla sft with model.strategy=megatron is not implemented yet; use fsdp2"),
    (lambda cfg: isinstance(cfg, NLASFTConfig) and cfg.nla.injection.mode == "project",
     lambda cfg: "nla.injection.mode=project (a learned map of the vector) is not implemented yet; use replace or add"),
]

NLA_EVAL_UNIMPLEMENTED: list[Row] = [
    (lambda cfg: cfg.nla.injection.mode == "project",
     lambda cfg: "nla.injection.mode=project (a learned map of the vector) is not implemented yet; use replace or add"),
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
