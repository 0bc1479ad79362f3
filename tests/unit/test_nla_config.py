"""NLA configuration: the fork's run files load with the fork's values, and its late or silent failures stop at load."""

import re
import textwrap
from pathlib import Path

import pytest

from ember.config import ConfigError, NotImplementedFeature, check_implemented, config_to_yaml, load_config
from ember.config.describe import describe_keys
from ember.config.features import NLA_EVAL_UNIMPLEMENTED, unimplemented_features
from ember.config.placement import named_pool_note, plan_placement
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig

RUNS = Path(__file__).resolve().parents[1] / "nla_configs"
A = "actor_rollout_ref"


def run_file(name, overrides=(), schema=NLATrainConfig):
    return load_config(list(overrides), config_path=str(RUNS), config_name=name, schema=schema)


def base(overrides=()):
    return load_config(list(overrides), config_name="nla_grpo_full", schema=NLATrainConfig)


def error_of(overrides, name="runs/qwen_7b/rl_grpo"):
    with pytest.raises(ConfigError) as error:
        run_file(name, overrides)
    return str(error.value)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_fsdp_file_on_8_gpus_loads_with_the_forks_values():
    cfg = run_file("runs/qwen_7b/rl_grpo")
    actor, rollout, critic = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic
    assert (cfg.data.train_batch_size, rollout.n) == (64, 8)
    assert actor.ppo_mini_batch_size == critic.ppo_mini_batch_size == 64  # 512 experiences = 64 prompts × 8
    assert cfg.trainer.mini_batch_counts == "prompts" and cfg.trainer.ppo_mini_batch_size == 512
    assert actor.fsdp_config.param_offload and actor.fsdp_config.optimizer_offload and actor.fsdp_config.model_dtype == "bf16"
    assert critic.model.fsdp_config.param_offload and critic.optim.lr == 1e-9 and actor.optim.weight_decay == 0.001
    assert critic.output_layer_index == 20 and critic.model.truncate_at_layer is None and critic.enable
    assert (rollout.name, rollout.disable_radix_cache, rollout.temperature, rollout.response_length) == ("nla_sglang", True, 0.7, 50)
    assert (cfg.ray_init.num_cpus, cfg.ray_init.num_gpus) == (32, 8)
    placement = plan_placement(cfg)
    assert not placement.split and placement.pool_of("critic").size == 8  # the base's 0-GPU pools are dropped
    assert cfg.nla_eval.enabled and set(cfg.nla_eval.eval_files) == {"QA", "2hop"}
    assert cfg.nla_eval.num_generations_per_prompt == 4
    assert cfg.nla_eval.template == "Explain the following: <concept>{injection_character}</concept>\n"
    assert cfg.actor_rollout_ref.nla == cfg.nla and cfg.nla.injection.mode == "replace"


def test_megatron_file_extending_the_fsdp_file_splits_tp4_actor_and_tp4_critic():
    cfg = run_file("runs/qwen_7b/rl_grpo_megatron")
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    assert actor.strategy == critic.strategy == "megatron"
    assert actor.megatron.tensor_model_parallel_size == critic.megatron.tensor_model_parallel_size == 4
    assert actor.megatron.override_model_config == {"model_config": {"use_cache": False}}
    assert actor.megatron.override_transformer_config["recompute_num_layers"] == 1
    assert actor.fsdp_config == FSDPConfig() and critic.model.fsdp_config == FSDPConfig()  # null: no FSDP settings
    assert critic.model.path == "Qwen/Qwen2.5-7B-Instruct"  # inherited from rl_grpo
    placement = plan_placement(cfg)
    assert placement.split
    assert [(pool.name, pool.first_gpu, pool.size) for pool in placement.pools] == [("actor_rollout", 0, 4), ("critic", 4, 4)]
    assert actor.ppo_mini_batch_size == 64


def test_tp2_file_on_2_gpus_shares_them():
    cfg = run_file("runs/qwen_7b/rl_grpo_megatron_tp2")
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.critic.megatron.tensor_model_parallel_size == 2 and cfg.trainer.n_gpus_per_node == 2
    assert cfg.ray_init.num_gpus == 2
    placement = plan_placement(cfg)
    assert not placement.split and placement.colocated("actor_rollout", "critic")
    assert placement.pool_of("critic").size == 2


def test_ember_base_carries_the_forks_defaults():
    cfg = base()
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    assert (rollout.name, rollout.n, rollout.top_p, rollout.gpu_memory_utilization) == ("nla_sglang", 4, 0.9, 0.4)
    assert (actor.strategy, actor.ppo_micro_batch_size_per_gpu, actor.optim.lr_warmup_steps) == ("fsdp2", 32, 50)
    assert actor.ppo_mini_batch_size == 8  # the fork's 32 experiences at n=4: four updates per batch of 32 prompts
    assert (cfg.critic.optim.lr, cfg.algorithm.adv_estimator, cfg.data.max_prompt_length) == (5e-5, "grpo", 128)
    assert cfg.nla.injection.position == "manual" and cfg.nla.injection.injection_token is None
    assert not actor.use_kl_loss and cfg.trainer.logger == ["console", "wandb"]


def test_run_file_extending_the_base_by_absolute_name_loads_from_any_depth(tmp_path):
    write(tmp_path / "runs/deep/mine.yaml", """
        # @package _global_
        defaults: [/nla_grpo_full, _self_]
        nla: {injection: {mode: add}}
        actor_rollout_ref: {rollout: {n: 2}, actor: {ppo_mini_batch_size: 64}}
    """)
    cfg = load_config([], config_path=str(tmp_path), config_name="runs/deep/mine", schema=NLATrainConfig)
    assert cfg.actor_rollout_ref.nla.injection.mode == "add"  # actor_rollout_ref.nla follows nla
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 32


def test_printed_config_loads_back_equal_without_converting_twice(tmp_path):
    cfg = run_file("runs/qwen_7b/rl_grpo_megatron")
    write(tmp_path / "printed.yaml", config_to_yaml(cfg))
    again = load_config([], config_path=str(tmp_path), config_name="printed", schema=NLATrainConfig)
    assert again == cfg and again.actor_rollout_ref.actor.ppo_mini_batch_size == 64


def test_prompt_counted_mini_batches_are_kept_and_data_batch_size_is_train_batch_size():
    cfg = base(["trainer.mini_batch_counts=prompts", "data.batch_size=16", f"{A}.actor.ppo_mini_batch_size=8"])
    assert cfg.data.train_batch_size == 16 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8


def test_mini_batch_not_a_multiple_of_n_names_one_update_per_batch():
    message = error_of([f"{A}.actor.ppo_mini_batch_size=500"])
    assert "ppo_mini_batch_size=500 counts experiences" in message and "must be a multiple of rollout.n=8" in message
    assert "data.train_batch_size × n = 512" in message


def test_megatron_critic_pipeline_guard_first_line_and_ways_out():
    message = error_of(["critic.megatron.pipeline_model_parallel_size=2"], name="runs/qwen_7b/rl_grpo_megatron")
    lines = message.splitlines()
    assert lines[0] == ("NLA Megatron critic does not support pipeline parallelism (PP=2); "
                        "set pipeline_model_parallel_size: 1")
    assert "critic.output_layer_index=20" in message
    for way in ("pipeline_model_parallel_size=1", "critic.output_layer_index=-1", "tensor_model_parallel_size"):
        assert way in message


@pytest.mark.parametrize("overrides", [["critic.output_layer_index=-1"], ["critic.output_layer_index=null"]])
def test_the_fork_guard_spares_the_last_layer_but_ember_runs_the_reconstructor_on_one_stage(overrides):
    pipeline = ["critic.megatron.tensor_model_parallel_size=2", "critic.megatron.pipeline_model_parallel_size=2"]
    with pytest.raises(ConfigError) as error:
        run_file("runs/qwen_7b/rl_grpo_megatron", pipeline + overrides)
    message = str(error.value)
    assert not message.startswith("NLA Megatron critic")  # the fork's sentence is for an inner layer only
    assert "critic.megatron.pipeline_model_parallel_size=2: NLA's reconstructor on strategy megatron runs on one " \
           "pipeline stage; set it to 1" in message
    fsdp = run_file("runs/qwen_7b/rl_grpo_megatron", pipeline + overrides + ["critic.strategy=fsdp2",
                                                                             "critic.model.fsdp_config={}"])
    assert fsdp.critic.megatron.pipeline_model_parallel_size == 2  # an FSDP2 critic never reads the subtree


@pytest.mark.parametrize("overrides, expected", [
    (["critic.megatron.context_parallel_size=2"], "critic.megatron.context_parallel_size=2: NLA's reconstructor reads "
                                                   "each sample's last token"),
    (["critic.megatron.override_transformer_config.recompute_granularity=full", "critic.model.truncate_at_layer=20"],
     "recompute_granularity=full recomputes whole decoder layers, so an inner layer's output"),
])
def test_megatron_reconstructor_layouts_it_cannot_run_stop_at_load(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        run_file("runs/qwen_7b/rl_grpo_megatron", overrides)
    run_file("runs/qwen_7b/rl_grpo_megatron", overrides + ["critic.strategy=fsdp2", "critic.model.fsdp_config={}"])


@pytest.mark.parametrize("index", [-1, 28])  # 28: the last of Qwen2.5-7B's layers by number (known only to the engine)
def test_full_recompute_is_left_to_the_engine_unless_an_inner_layer_is_certain(index):
    cfg = run_file("runs/qwen_7b/rl_grpo_megatron", [
        "critic.megatron.override_transformer_config.recompute_granularity=full", f"critic.output_layer_index={index}"])
    assert unimplemented_features(cfg) == []


@pytest.mark.parametrize("overrides, expected", [
    ([f"{A}.actor.fsdp_config=null"], "fsdp_config=null drops the FSDP settings, which only a Megatron role may do"),
    (["nla.injection.layer_indices=[3]"], "nla.injection.layer_indices=[3]: only [0]"),
    (["nla.injection.projection_dim=64"], "projection_dim=64 is used by mode project only"),
    (["nla.injection.injection_token=ab"], "must be one character"),
    (["nla.scale=0"], "nla.scale=0.0 must be greater than 0"),
    (["critic.critic_prompt=' '"], "critic.critic_prompt is empty"),
    (["critic.model.truncate_at_layer=10"], "critic.output_layer_index must name one of hidden_states 0..10; it is 20"),
    (["critic.model.truncate_at_layer=0"], "keeps no layer"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae would read the critic as a value function"),
    (["~nla_eval.eval_files"], "nla_eval.enabled=true needs nla_eval.eval_files"),
    (["nla_eval.eval_file=a.parquet"], "both set"),
    (["nla_eval.template='{source} <concept>{injection_character}</concept>'"], "nla_eval.template uses {source}"),
    (["nla_eval.template='no marker here'"], "must hold {injection_character} exactly once"),
    (["nla_eval.num_generations_per_prompt=0"], "nla_eval.num_generations_per_prompt=0 is out of range"),
    (["trainer.steps_per_update=0"], "trainer.steps_per_update=0 is out of range"),
    (["critic.pooling_strategy=mean"], "expected one of: last"),
])
def test_each_nla_check_names_the_key_and_the_fix(overrides, expected):
    assert expected in error_of(overrides)


def test_truncated_critic_reading_a_layer_it_keeps_loads():
    assert run_file("runs/qwen_7b/rl_grpo", ["critic.model.truncate_at_layer=20"]).critic.model.truncate_at_layer == 20


@pytest.mark.parametrize("pools, split, note", [
    ({"actor_rollout": 8, "reward": 0, "critic_pool": 8}, False, None),
    ({"rollout_workers": 4, "critics": 4}, True, "puts the roles on separate GPUs as written (rollout_workers 4 + critics 4)"),
    # The fork never reads its pools and shares every GPU: a file it runs is not refused here.
    ({"train": 4, "critic": 4}, False, "is not used (ray_kwargs.resource_pool.train names no role"),
    ({"actor_rollout": 8, "critic": 0}, False, "none for critic"),
    ({"actor_rollout": 6, "critic": 4}, False, "asks for actor_rollout 6 + critic 4 = 10 GPUs but the run has 8 GPUs"),
    ({"actor_rollout": 4, "critic": 2}, False, "must add up to 8, or each ask for all 8 to share them"),
])
def test_named_pools_map_roles_by_name_and_what_the_fork_ignores_is_shared(pools, split, note):
    overrides = [f"+ray_kwargs.resource_pool.{name}.num_gpus={gpus}" for name, gpus in pools.items()]
    cfg = run_file("runs/qwen_7b/rl_grpo", overrides)
    placement = plan_placement(cfg)
    assert placement.split == split
    assert placement.pool_of("actor_rollout").size + (placement.pool_of("critic").size if split else 0) == 8
    assert placement.pool_of("ref") == placement.pool_of("actor_rollout")
    if note is None:
        assert named_pool_note(cfg) is None
    else:
        assert note in named_pool_note(cfg)


def test_named_pools_beside_another_form_are_refused():
    message = error_of(["+ray_kwargs.resource_pool.actor.num_gpus=8", "+ray_kwargs.resource_pool.critic.num_gpus=8",
                        "+resource_pool.actor_rollout.num_gpus=8"])
    assert "give the pools in one form" in message and "not both" in message


def test_ember_train_takes_ray_kwargs_too():
    cfg = load_config(["ray_kwargs.ray_init.num_cpus=3", "+ray_kwargs.ray_init.num_gpus=1"])
    assert (cfg.ray_init.num_cpus, cfg.ray_init.num_gpus) == (3, 1)


def test_the_fsdp2_file_and_the_megatron_file_run():
    cfg = run_file("runs/qwen_7b/rl_grpo", ["trainer.rollout_data_dir=null"])
    assert unimplemented_features(cfg) == []
    megatron = run_file("runs/qwen_7b/rl_grpo_megatron")
    assert unimplemented_features(megatron) == []  # actor and reconstructor on Megatron, as the fork's file has them
    assert unimplemented_features(run_file("runs/qwen_7b/rl_grpo_megatron", [
        "critic.strategy=fsdp2", "critic.model.fsdp_config={}", "trainer.n_gpus_per_node=8"])) == []
    assert unimplemented_features(run_file("runs/qwen_7b/rl_grpo", ["actor_rollout_ref.actor.strategy=megatron"])) == []
    assert unimplemented_features(megatron, NLA_EVAL_UNIMPLEMENTED) == []  # eval only generates, on ember's engine
    assert len(unimplemented_features(run_file("runs/qwen_7b/rl_grpo", ["nla.injection.mode=project"]))) == 1


def test_sft_file_loads_with_names_filled_and_the_forks_dataset_class_accepted():
    cfg = run_file("nla_sft_7b_8gpu", schema=NLASFTConfig)
    assert (cfg.data.prompt_key, cfg.data.response_key, cfg.data.micro_batch_size_per_gpu) == ("prompt", "response", 32)
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == ("nla-sft", "qwen2-5-7b-instruct-actor-canonical")
    assert cfg.nla.critic.output_layer_index == 20 and cfg.nla.critic_epochs == 3 and cfg.engine == {"strategy": "fsdp2"}
    assert "hf_model" in cfg.trainer.checkpoint.save_contents
    assert unimplemented_features(cfg) == []  # the fork's dataset class is ember nla sft's own reader
    critic = run_file("nla_sft_7b_8gpu", ["nla.train_mode=critic", "data.train_files=x_random.parquet"], NLASFTConfig)
    assert critic.trainer.experiment_name == "qwen2-5-7b-instruct-critic-random"


@pytest.mark.parametrize("overrides, expected", [
    (["data.custom_cls.path=my.dataset"], "ember nla sft reads NLA rows itself"),
    (["model.truncate_layers=8"], "the actor is always the full model"),
    (["nla.train_mode=critic", "nla.critic.truncate_layers=10"],
     "nla.critic.output_layer_index must name one of hidden_states 0..10; it is 20"),
    (["nla.train_mode=critic", "nla.critic_lr=0"], "nla.critic_lr=0.0 is out of range"),
    (["nla.train_mode=both"], "expected one of: actor, critic"),
])
def test_sft_checks(overrides, expected):
    with pytest.raises(ConfigError) as error:
        run_file("nla_sft_7b_8gpu", overrides, NLASFTConfig)
    assert expected in str(error.value)


def test_extraction_file_loads_and_hub_datasets_stop_at_the_feature_check():
    cfg = run_file("runs/qwen_7b/rl_train", schema=NLAExtractConfig)
    assert (cfg.mode, cfg.model.layer_index, cfg.sampling.activations_per_sample, cfg.seed) == ("rl", 20, 1, 42)
    assert cfg.output.random_variant.enabled and cfg.output.random_variant.source_column == "activation_vector_source_uuid"
    assert cfg.prompt.messages == [{"role": "user", "template": "Explain the following: <concept>{injection_token}</concept>\n"}]
    with pytest.raises(NotImplementedFeature, match="reading hub datasets is not implemented yet"):
        check_implemented(cfg)
    sft = run_file("runs/qwen_7b/sft_train", schema=NLAExtractConfig)
    assert sft.response.template == "{processed_response}" and unimplemented_features(sft) == []


@pytest.mark.parametrize("overrides, expected", [
    (["dataset.chat_column=chat"], "dataset.text_column (plain text) or dataset.chat_column (chats), one of them"),
    (["prompt.messages=[{role: user, template: 'no marker'}]"], "hold {injection_token} 0 times"),
    (["prompt.messages=[{template: '{injection_token} {injection_token}'}]"], "hold {injection_token} 2 times"),
    (["prompt.messages=[{text: x}]"], "must be a mapping of template"),
    (["response.template='{summary}'"], "response.template uses {summary}"),
    (["mode=eval", "dataset.text_column=null", "dataset.chat_column=chat"], "mode eval reads each row's source_prompt"),
    (["sampling.activations_per_sample=0"], "sampling.activations_per_sample=0 is out of range"),
])
def test_extraction_checks(overrides, expected):
    with pytest.raises(ConfigError) as error:
        run_file("runs/qwen_7b/sft_train", overrides, NLAExtractConfig)
    assert expected in str(error.value)


@pytest.mark.parametrize("schema", [NLATrainConfig, NLASFTConfig, NLAExtractConfig])
def test_every_nla_key_is_described(schema):
    lines = describe_keys(schema).splitlines()
    assert all("  # " in line and not line.endswith("# ") for line in lines)
    assert any(line.startswith("actor_rollout_ref.nla.injection.mode") for line in lines) or schema is not NLATrainConfig


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=remax", "adv_estimator=remax (a greedy explanation's reconstruction"),
    ("algorithm.filter_groups.enable=true algorithm.filter_groups.metric=score", "algorithm.filter_groups (DAPO's dynamic sampling)"),
])
def test_rl_switches_the_nla_loop_does_not_take_are_refused(override, message):
    cfg = run_file("runs/qwen_7b/rl_grpo", ["trainer.rollout_data_dir=null", *override.split()])
    assert any(message in text for text in unimplemented_features(cfg))
