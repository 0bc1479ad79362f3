"""Switches whose code has not landed are refused before a real run, never when printing the config."""

import re

import pytest

from ember.config import NotImplementedFeature, check_implemented, load_config
from ember.config.features import unimplemented_features

A = "actor_rollout_ref"


def test_defaults_need_nothing_unimplemented():
    assert unimplemented_features(load_config([])) == []


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.actor.strategy=megatron", "algorithm.adv_estimator=grpo", f"{A}.rollout.name=hf"],
     f"{A}.rollout.name=hf generates with the actor's transformers module, which strategy megatron has not"),
    ([f"{A}.rollout.name=vllm", f"{A}.rollout.require_named_engine=true"],
     f"{A}.rollout.name=vllm with rollout.require_named_engine=true: vllm itself is not available in ember"),
    (["trainer.noise_injection.enabled=true", f"{A}.rollout.name=hf"],
     "trainer.noise_injection with actor_rollout_ref.rollout.name=hf: the hf rollout generates with the actor's own module"),
    (["reward_model.enable=true", "reward_model.model.path=/rm"], "reward_model.enable=true is not implemented yet"),
    ([f"{A}.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"], "ulysses_sequence_parallel_size=2"),
    ([f"{A}.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2", f"{A}.rollout.name=hf"],
     f"{A}.rollout.tensor_model_parallel_size=2 with {A}.rollout.name=hf: the hf rollout generates with the actor's"),
    ([f"{A}.rollout.mode=async"], f"{A}.rollout.mode=async without multi_turn.enable (a rollout server for single-turn "
                                  "agent loops) is not implemented yet"),
    ([f"{A}.hybrid_engine=false", f"{A}.rollout.name=hf"],
     f"{A}.hybrid_engine=false with {A}.rollout.name=hf: the hf rollout generates with the actor's own module"),
    ([f"{A}.hybrid_engine=false", "async_training.mode=one_step_off", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.metric=acc", f"{A}.rollout.name=ember"],
     "async_training.mode=one_step_off with algorithm.filter_groups"),
    ([f"{A}.actor.fsdp_config.fsdp_size=2", "trainer.n_gpus_per_node=4"], "fsdp_config.fsdp_size (hybrid sharding, HSDP)"),
    (["trainer.default_hdfs_dir=hdfs://x/ckpt"], "trainer.default_hdfs_dir=hdfs://x/ckpt: copying checkpoints to remote"),
    ([f"{A}.actor.strategy=megatron", f"{A}.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2",
      f"{A}.rollout.name=ember"], f"{A}.actor.megatron.context_parallel_size=2 is not implemented yet"),
    ([f"{A}.actor.use_kl_loss=true", f"{A}.actor.kl_loss_type=full"], f"{A}.actor.kl_loss_type=full (the exact KL"),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"], "algorithm.kl_penalty=full (the exact KL"),
])
def test_each_unimplemented_switch_is_named(overrides, message):
    cfg = load_config(overrides)
    with pytest.raises(NotImplementedFeature) as error:
        check_implemented(cfg)
    assert message in str(error.value)


def test_megatron_offload_of_actor_reference_and_critic_is_implemented():
    offload = [f"{role}.megatron.{key}=true" for role in (f"{A}.actor", f"{A}.ref", "critic")
               for key in ("param_offload", "grad_offload", "optimizer_offload")]
    cfg = load_config([f"{A}.actor.strategy=megatron", f"{A}.ref.strategy=megatron", "critic.strategy=megatron",
                       "algorithm.adv_estimator=gae", f"{A}.actor.use_kl_loss=true", *offload])
    assert cfg.critic.megatron.optimizer_offload and cfg.actor_rollout_ref.actor.megatron.grad_offload
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
    cfg = load_config(["reward_model.enable=true", "reward_model.model.path=/rm", f"{A}.model.enable_activation_offload=true"])
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
    ("actor_rollout_ref.model.enable_activation_offload=true", "enable_activation_offload=true is not implemented yet"),
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


@pytest.mark.parametrize("key, value, message", [
    ("use_dist_checkpointing", "true", "use_dist_checkpointing=true (initial weights from a Megatron checkpoint) is not "
                                      "implemented yet"),
    ("override_mcore_model_config", "{rotary_percent: 0.5}", "override_mcore_model_config=['rotary_percent'] is not "
                                                             "implemented yet"),
])
def test_megatron_keys_without_code_are_refused_by_name(key, value, message):
    cfg = load_config([f"{A}.actor.strategy=megatron", "algorithm.adv_estimator=grpo", f"{A}.actor.megatron.{key}={value}"])
    with pytest.raises(NotImplementedFeature, match=re.escape(f"{A}.actor.megatron.{message}")):
        check_implemented(cfg)


def test_use_cache_in_override_mcore_model_config_is_accepted_as_the_forks_30b_files_write_it():
    megatron = [f"{A}.actor.strategy=megatron", "algorithm.adv_estimator=grpo"]
    check_implemented(load_config([*megatron, f"{A}.actor.megatron.override_mcore_model_config={{use_cache: false}}"]))
    with pytest.raises(NotImplementedFeature, match=re.escape("override_mcore_model_config=['rotary_percent']")):
        check_implemented(load_config([*megatron, f"{A}.actor.megatron.override_mcore_model_config="
                                                  "{use_cache: false, rotary_percent: 0.5}"]))


def test_vllm_and_sglang_names_run_on_embers_engine():
    for name in ("vllm", "sglang"):
        cfg = load_config([f"{A}.rollout.name={name}"])
        assert cfg.actor_rollout_ref.rollout.engine == "ember" and cfg.actor_rollout_ref.rollout.name == name
        assert unimplemented_features(cfg) == []
    assert load_config([f"{A}.rollout.name=hf"]).actor_rollout_ref.rollout.engine == "hf"


def test_the_stand_in_note_names_what_it_honours_and_what_it_does_not():
    from ember.trainer.rank_setup import stand_in_note

    rollout = load_config([f"{A}.rollout.name=vllm", f"{A}.rollout.load_format=safetensors",
                           f"+{A}.rollout.engine_kwargs.vllm.swap_space=4"]).actor_rollout_ref.rollout
    note = stand_in_note(rollout)
    assert note.startswith(f"{A}.rollout.name=vllm: ember's own engine generates in its place")
    assert "gpu_memory_utilization" in note and "require_named_engine=true" in note
    assert note.endswith("not applied: load_format=safetensors, engine_kwargs.vllm.swap_space")
    plain = stand_in_note(load_config([f"{A}.rollout.name=sglang"]).actor_rollout_ref.rollout)
    assert "not applied" not in plain
