"""verl's own config folders load: the NLA fork's real files (tests/verl_fork_configs/, see its README) compose as
verl composes them, `_target_` and verl's keys without an ember field accepted, unknown keys still errors."""

import logging
import os
from pathlib import Path

import pytest

from ember.config import ConfigError, EmberConfig, load_config
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig

FORK = str(Path(__file__).resolve().parents[1] / "verl_fork_configs")
A = "actor_rollout_ref"


def fork_file(name, overrides=(), schema=NLATrainConfig):
    return load_config(list(overrides), config_path=FORK, config_name=name, schema=schema)


def verl_warnings(caplog):
    return [record.getMessage() for record in caplog.records if "verl keys" in record.getMessage()]


def test_verls_ppo_trainer_composes_its_groups_as_verl_does(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = fork_file("ppo_trainer", [f"{A}.rollout.name=vllm"], schema=EmberConfig)
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    assert actor.optim.lr == 1e-6 and critic.optim.lr == 1e-5  # actor.yaml / critic.yaml over optim/fsdp.yaml's 1e-3
    assert actor.ppo_mini_batch_size == 256 and actor.clip_ratio == 0.2 and actor.strategy == "fsdp"
    assert cfg.algorithm.adv_estimator == "gae" and cfg.trainer.n_gpus_per_node == 8
    assert verl_warnings(caplog) == []  # every verl key at verl's default: nothing to say


def test_a_mandatory_value_of_verls_files_is_named():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name must be given: .*\?\?\?"):
        fork_file("ppo_trainer", schema=EmberConfig)


def test_the_forks_rl_run_file_loads_from_the_forks_own_folder():
    cfg = fork_file("runs/qwen_7b/rl_grpo")
    actor, rollout, critic = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic
    assert (cfg.data.train_batch_size, rollout.n, rollout.name) == (64, 8, "nla_sglang")
    assert actor.ppo_mini_batch_size == critic.ppo_mini_batch_size == 64  # 512 experiences = 64 prompts × 8
    assert actor.fsdp_config.param_offload and critic.output_layer_index == 20 and critic.optim.lr == 1e-9
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.nla.injection.mode == "replace"


def test_the_forks_sft_file_loads_over_verls_sft_trainer():
    cfg = fork_file("nla_sft_7b_8gpu", schema=NLASFTConfig)
    assert cfg.data.micro_batch_size_per_gpu == 32 and cfg.data.train_batch_size == 256
    assert cfg.model.partial_pretrain == "Qwen/Qwen2.5-7B-Instruct" and cfg.optim.lr == 5e-5


def test_a_verl_key_without_effect_is_named_once_when_it_departs_from_verls_default(caplog):
    with caplog.at_level(logging.WARNING):
        fork_file("runs/qwen_7b/rl_grpo", ["trainer.esi_redundant_time=5", f"{A}.actor.profiler.enable=true"])
    (message,) = verl_warnings(caplog)
    assert "trainer.esi_redundant_time=5 (in override trainer.esi_redundant_time=5)" in message
    assert f"{A}.actor.profiler={{'enable': True}}" in message


def test_a_verl_key_ember_would_silently_run_otherwise_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.use_pf_ppo=True .*PF-PPO"):
        fork_file("runs/qwen_7b/rl_grpo", ["algorithm.use_pf_ppo=true"])
    with pytest.raises(ConfigError, match=r"multi_turn.interaction_config_path='x.yaml' .*interactions"):
        fork_file("runs/qwen_7b/rl_grpo", [f"{A}.rollout.multi_turn.interaction_config_path=x.yaml"])


def test_unknown_keys_are_still_errors_beside_verls(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key actor_rollout_ref.actor.not_a_key"):
        fork_file("runs/qwen_7b/rl_grpo", [f"{A}.actor.not_a_key=1"])
    run = tmp_path / "run.yaml"
    run.write_text("defaults: [ppo_trainer, _self_]\ncritic:\n  optim:\n    _target_: x.Y\n    lr_typo: 1\n")
    with pytest.raises(ConfigError, match=rf"unknown key critic.optim.lr_typo in {run}"):
        load_config([f"{A}.rollout.name=vllm"], config_path=str(tmp_path), config_name="run")


def composed_files(name, choices=(), additions=()):
    from ember.config.compose import compose_layers

    layers = compose_layers(FORK, name, NLATrainConfig.builtin_bases, tuple(choices), tuple(additions))
    return [os.path.relpath(os.path.normpath(layer.source), FORK) for layer in layers]


def test_override_entries_of_a_defaults_list_replace_the_bases_choice():
    files = composed_files("runs/qwen_30b/rl_grpo_megatron")
    assert "actor/megatron_actor.yaml" in files and "critic/megatron_critic.yaml" in files
    assert "actor/dp_actor.yaml" not in files and "critic/dp_critic.yaml" not in files
    assert files.index("optim/megatron.yaml") < files.index("actor/megatron_actor.yaml")  # its own defaults first
    cfg = fork_file("runs/qwen_30b/rl_grpo_megatron")
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    assert actor.strategy == critic.strategy == "megatron" and actor.megatron.expert_model_parallel_size == 8


def test_group_choices_on_the_command_line_pick_a_file_of_the_group():
    for choice in ("actor@actor_rollout_ref.actor=megatron_actor", "actor=megatron_actor"):
        cfg = fork_file("ppo_trainer", [choice, f"{A}.rollout.name=vllm"], schema=EmberConfig)
        assert cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.critic.strategy == "fsdp"
    cfg = fork_file("runs/qwen_7b/rl_grpo", ["+actor@actor_rollout_ref.actor=megatron_actor"])
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"  # added after the run file's own keys
    with pytest.raises(ConfigError, match=r"override actor@critic=megatron_actor chooses megatron_actor for group "
                                          r"actor@critic, but no defaults list holds"):
        fork_file("ppo_trainer", ["actor@critic=megatron_actor", f"{A}.rollout.name=vllm"], schema=EmberConfig)


def test_unquoted_command_line_text_is_one_string_as_hydra_reads_it():
    cfg = fork_file("runs/qwen_7b/rl_grpo", ["critic.critic_prompt=summary of the following text: "])
    assert cfg.critic.critic_prompt == "summary of the following text:"  # Hydra strips the ends of unquoted text
    cfg = fork_file("runs/qwen_7b/rl_grpo", ["trainer.logger=[console]", "critic.critic_prompt='a: b '"])
    assert cfg.trainer.logger == ["console"] and cfg.critic.critic_prompt == "a: b "


def test_a_truncated_critic_sft_file_is_checked_only_where_the_mode_reads_the_critic():
    actor = fork_file("nla_sft_7b_8gpu_truncated_critic_only", ["nla.critic_lr=0"], schema=NLASFTConfig)
    assert actor.nla.train_mode == "actor" and actor.nla.critic.truncate_layers == 10  # the fork's actor SFT reads neither
    with pytest.raises(ConfigError, match=r"nla.critic.truncate_layers=10 keeps decoder layers 1..10, so "
                                          r"nla.critic.output_layer_index must name one of hidden_states 0..10; it is 20"):
        fork_file("nla_sft_7b_8gpu_truncated_critic_only", ["nla.train_mode=critic"], schema=NLASFTConfig)


def test_an_nla_run_file_without_a_defaults_list_extends_the_nla_base_and_says_which(tmp_path, caplog):
    run = tmp_path / "run.yaml"
    run.write_text("data:\n  train_batch_size: 8\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 32\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_config([], config_path=str(tmp_path), config_name="run", schema=NLATrainConfig)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.name == "nla_sglang"  # not PPO's gae
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8  # 32 experiences of the base's rollout.n=4
    assert any(f"{run} has no defaults list: it extends nla_grpo_full (ember's built-in base)" in record.getMessage()
               for record in caplog.records)
    (tmp_path / "nla_grpo_full.yaml").write_text(
        "defaults: [ppo_trainer, _self_]\nalgorithm:\n  adv_estimator: rloo\nactor_rollout_ref:\n  rollout:\n    n: 4\n"
        "critic:\n  ppo_mini_batch_size: 32\n")
    cfg = load_config([], config_path=str(tmp_path), config_name="run", schema=NLATrainConfig)
    assert cfg.algorithm.adv_estimator == "rloo"  # the folder's own base, as `- /nla_grpo_full` would read it
    run.write_text("defaults: [_self_]\ndata:\n  train_batch_size: 8\n")
    from ember.config.compose import compose_layers

    layers = compose_layers(str(tmp_path), "run", NLATrainConfig.builtin_bases, implicit_base="nla_grpo_full")
    assert [layer.source for layer in layers] == [str(run)]  # an explicit list is taken as written


# Keys verl's config gained by early 2026 (verl b178a3cd, _generated_ppo_trainer.yaml and its Megatron twin), each at
# verl's default, as a user's run file over verl's folder carries them.
NEWER_VERL_KEYS_AT_DEFAULT = """
defaults: [ppo_trainer, _self_]
data: {train_max_samples: -1, val_max_samples: -1, seed: null, image_patch_size: 14,
       tool_config_path: "${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path, null}"}
actor_rollout_ref:
  actor:
    loss_scale_factor: null
    tau_pos: 1.0
    tau_neg: 1.05
    calculate_entropy: false
    use_prefix_grouper: false
    calculate_sum_pi_squared: false
    sum_pi_squared_checkpointing: false
    rollout_n: ${oc.select:actor_rollout_ref.rollout.n,1}
    router_replay: {mode: disabled, record_file: null, replay_file: null}
    optim: {optimizer: AdamW, optimizer_impl: torch.optim}
    fsdp_config: {dtype: bfloat16}
  ref: {rollout_n: 1, router_replay: {mode: disabled}, fsdp_config: {dtype: bfloat16}}
  rollout:
    expert_parallel_size: 1
    pipeline_model_parallel_size: 1
    logprobs_mode: processed_logprobs
    scheduling_policy: fcfs
    checkpoint_engine: {backend: naive, update_weights_bucket_megabytes: 2048}
    enable_rollout_routing_replay: false
    prometheus: {enable: false, port: 9090}
  model:
    tiled_mlp: {enabled: false, num_shards: 4}
    mtp: {enable: false, enable_train: false, method: mtp}
critic: {optim: {optimizer_impl: torch.optim}, model: {fsdp_config: {dtype: bfloat16}, tiled_mlp: {enabled: false}}}
reward_manager: {source: register, name: naive, module: {_target_: x.ModuleConfig, path: null, name: custom_reward_manager}}
reward_model: {use_reward_loop: true, reward_loop_source: register, reward_loop_module_path: null,
               reward_loop_class_name: null, rollout: {name: "???", tensor_model_parallel_size: 2}}
transfer_queue: {enable: false}
"""


def test_the_keys_newer_verl_writes_load_quietly_at_verls_defaults_and_are_refused_where_ember_would_differ(
        tmp_path, caplog):
    (tmp_path / "run.yaml").write_text(NEWER_VERL_KEYS_AT_DEFAULT)

    def run(*overrides):
        return load_config([f"{A}.rollout.name=vllm", *overrides], config_path=str(tmp_path),
                           config_name="run", schema=EmberConfig)

    with caplog.at_level(logging.WARNING):
        cfg = run()
    assert verl_warnings(caplog) == []
    assert cfg.data.seed == 1 and cfg.data.train_max_samples == -1 and cfg.actor_rollout_ref.actor.loss_scale_factor is None
    assert run("data.train_max_samples=100", f"{A}.actor.loss_scale_factor=2048").data.train_max_samples == 100
    for override, named in ((f"{A}.model.mtp.enable=true", "multi-token prediction"),
                            (f"{A}.actor.router_replay.mode=R3", "routing replay"),
                            (f"{A}.rollout.expert_parallel_size=2", "tensor_model_parallel_size"),
                            (f"{A}.rollout.logprobs_mode=raw_logprobs", "log_softmax"),
                            ("reward_manager.module.path=my_manager.py", "reward manager"),
                            (f"{A}.actor.optim.optimizer_impl=bitsandbytes.optim", "AdamW")):
        with pytest.raises(ConfigError, match=named):
            run(override)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(f"{A}.model.tiled_mlp.enabled=true")
    (message,) = verl_warnings(caplog)
    assert "tiled MLP" in message
