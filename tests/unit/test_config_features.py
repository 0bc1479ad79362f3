"""Switches whose code has not landed are refused before a real run, never when printing the config."""

import re

import pytest

from ember.config import NotImplementedFeature, check_implemented, load_config
from ember.config.features import unimplemented_features

A = "actor_rollout_ref"


def test_defaults_need_nothing_unimplemented():
    assert unimplemented_features(load_config([])) == []


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.actor.strategy=megatron", "algorithm.adv_estimator=grpo"], f"{A}.actor.strategy=megatron is not implemented yet"),
    ([f"{A}.actor.strategy=megatron"], "critic.strategy=megatron is not implemented yet"),
    ([f"{A}.ref.strategy=megatron", f"{A}.actor.use_kl_loss=true"], f"{A}.ref.strategy=megatron is not implemented yet"),
    ([f"{A}.rollout.name=vllm"], f"{A}.rollout.name=vllm is not available in ember yet; use ember"),
    ([f"{A}.rollout.name=sglang"], f"{A}.rollout.name=sglang is not available in ember yet"),
    (["trainer.noise_injection.enabled=true"], "trainer.noise_injection.enabled=true is not implemented yet"),
    (["reward_model.enable=true", "reward_model.model.path=/rm"], "reward_model.enable=true is not implemented yet"),
    ([f"{A}.model.lora_rank=8"], f"{A}.model.lora_rank=8 (LoRA) is not implemented yet; use 0"),
    ([f"{A}.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"], "ulysses_sequence_parallel_size=2"),
    ([f"{A}.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
     f"{A}.rollout.tensor_model_parallel_size=2 (one generation engine over several GPUs) is not implemented yet"),
])
def test_each_unimplemented_switch_is_named(overrides, message):
    cfg = load_config(overrides)
    with pytest.raises(NotImplementedFeature) as error:
        check_implemented(cfg)
    assert message in str(error.value)


def test_reference_strategy_only_matters_when_the_reference_runs():
    cfg = load_config([f"{A}.ref.strategy=megatron"])
    assert unimplemented_features(cfg) == []


@pytest.mark.parametrize("overrides", [
    [f"{A}.actor.use_dynamic_bsz=true", "algorithm.adv_estimator=gae"],
    [f"{A}.rollout.log_prob_use_dynamic_bsz=true", f"{A}.ref.log_prob_use_dynamic_bsz=true", "critic.use_dynamic_bsz=true"],
])
def test_dynamic_batch_size_is_implemented(overrides):
    cfg = load_config(overrides)
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz or cfg.critic.use_dynamic_bsz
    assert unimplemented_features(cfg) == []


def test_packing_and_fused_kernels_are_implemented():
    cfg = load_config([f"{A}.model.use_remove_padding=true", f"{A}.model.use_fused_kernels=true",
                       "critic.model.use_remove_padding=true", "algorithm.adv_estimator=gae"])
    assert cfg.actor_rollout_ref.model.use_fused_kernels and cfg.critic.model.use_remove_padding
    assert unimplemented_features(cfg) == []


def test_several_switches_are_listed_together():
    cfg = load_config([f"{A}.rollout.name=vllm", f"{A}.model.use_liger=true"])
    messages = unimplemented_features(cfg)
    assert len(messages) == 2
    with pytest.raises(NotImplementedFeature, match="not implemented yet:\n  - "):
        check_implemented(cfg)


def test_implemented_algorithm_names_match_the_registries():
    from ember.algorithms import advantage_names, policy_loss_names
    from ember.config.features import IMPLEMENTED_ADVANTAGES, IMPLEMENTED_POLICY_LOSSES

    assert set(IMPLEMENTED_ADVANTAGES) == set(advantage_names())
    assert set(IMPLEMENTED_POLICY_LOSSES) == set(policy_loss_names())


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=opo", "algorithm.adv_estimator=opo is not implemented yet"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "loss_mode=clip_cov is not"),
    ("trainer.rollout_data_dir=/tmp/dump", "trainer.rollout_data_dir=/tmp/dump is not implemented yet"),
    ("reward_model.reward_manager=dapo", "reward_model.reward_manager=dapo is not implemented yet"),
    ("actor_rollout_ref.model.use_liger=true", "use_liger=true is not implemented yet"),
])
def test_keys_that_would_otherwise_be_ignored_stop_a_real_run(override, message):
    from ember.config import NotImplementedFeature, check_implemented, load_config

    with pytest.raises(NotImplementedFeature, match=re.escape(message)):
        check_implemented(load_config([override]))


def test_fsdp_offload_policy_is_accepted_and_refused_only_where_there_is_no_accelerator():
    from ember.distributed.device import device_type
    from ember.engines.fsdp.engine import EngineOptions

    check_implemented(load_config([f"{A}.actor.fsdp_config.offload_policy=True"]))
    if device_type() == "cpu":
        with pytest.raises(ValueError, match="computes on the CPU already: set offload_policy=false"):
            EngineOptions(model_path="unused", offload_policy=True)
