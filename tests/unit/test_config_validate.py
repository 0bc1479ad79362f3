"""Bad values are refused at load time with a message naming the key, the value and what is valid."""

import pytest

from ember.config import ConfigError, load_config

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def error_of(overrides):
    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    return str(error.value)


@pytest.mark.parametrize("override, expected", [
    ("data.train_batch_size=abc", "invalid value for data.train_batch_size: 'abc' (expected an integer)"),
    ("data.train_batch_size=1.5", "invalid value for data.train_batch_size: 1.5 (expected an integer)"),
    ("data.train_batch_size=true", "invalid value for data.train_batch_size: True (expected an integer)"),
    (f"{ACTOR}.use_kl_loss=maybe", f"invalid value for {ACTOR}.use_kl_loss: 'maybe' (expected true or false)"),
    (f"{ACTOR}.optim.lr=fast", f"invalid value for {ACTOR}.optim.lr: 'fast' (expected a number)"),
    (f"{ROLLOUT}.name=vlm", f"invalid value for {ROLLOUT}.name: 'vlm' (expected one of: ember, hf, vllm, sglang)"),
    ("data.truncation=cut", "(expected one of: error, left, right, middle)"),
    ("trainer.logger=['console','comet']", "(expected a list of items that are each one of: console, tensorboard, jsonl, wandb, mlflow; item 1 is 'comet')"),
    ("data.train_files={a: 1}", "invalid value for data.train_files: {'a': 1} (expected a string or a list of items that are each a string or null)"),
    ("data.reward_fn=[1]", "invalid value for data.reward_fn: [1] (expected a mapping)"),
    ("critic=null", "critic is a section; set its keys (critic.KEY=value), not None"),
    (f"{ROLLOUT}.max_model_len=long", "(expected an integer or null)"),
])
def test_wrong_types_name_key_value_and_valid_choices(override, expected):
    assert expected in error_of([override])


@pytest.mark.parametrize("override, expected", [
    ("data.max_prompt_length=-1", "data.max_prompt_length=-1 is out of range: it must be at least 1"),
    (f"{ROLLOUT}.n=0", f"{ROLLOUT}.n=0 is out of range: it must be at least 1"),
    (f"{ROLLOUT}.top_p=1.5", f"{ROLLOUT}.top_p=1.5 is out of range: it must be in [0.0, 1.0]"),
    (f"{ROLLOUT}.val_kwargs.top_p=-0.1", "val_kwargs.top_p=-0.1 is out of range"),
    (f"{ROLLOUT}.gpu_memory_utilization=0", "gpu_memory_utilization=0.0 is out of range: it must be in (0.0, 1.0]"),
    (f"{ROLLOUT}.top_k=-2", "top_k=-2 is out of range: it must be at least -1"),
    (f"{ACTOR}.megatron.tensor_model_parallel_size=0", "tensor_model_parallel_size=0 is out of range"),
    (f"{ACTOR}.clip_ratio_c=1.0", "clip_ratio_c=1.0 is out of range: it must be greater than 1.0"),
    ("algorithm.lam=1.2", "algorithm.lam=1.2 is out of range"),
    ("trainer.save_freq=-2", "trainer.save_freq=-2 is out of range: it must be at least -1"),
    (f"{ACTOR}.optim.betas=[0.9]", "betas=[0.9] is invalid: give two decay rates in [0, 1)"),
])
def test_values_out_of_range(override, expected):
    assert expected in error_of([override])


def test_probability_bounds_are_inclusive():
    cfg = load_config([f"{ROLLOUT}.top_p=0", f"{ROLLOUT}.val_kwargs.top_p=1", "algorithm.gamma=0"])
    assert cfg.actor_rollout_ref.rollout.top_p == 0.0


def test_mini_batch_must_divide_the_batch():
    message = error_of(["data.train_batch_size=100", f"{ACTOR}.ppo_mini_batch_size=16"])
    assert "data.train_batch_size=100 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=16" in message
    assert "[10, 20, 25]" in message  # the divisors of 100 nearest to 16


def test_mini_batch_responses_must_split_over_data_parallel_ranks():
    base = ["trainer.n_gpus_per_node=4", "data.train_batch_size=6", f"{ACTOR}.ppo_mini_batch_size=6"]
    message = error_of(base + [f"{ROLLOUT}.n=1"])
    assert f"{ACTOR}.ppo_mini_batch_size × {ROLLOUT}.n = 6 × 1 = 6 responses" in message
    assert "4 data-parallel ranks" in message
    assert load_config(base + [f"{ROLLOUT}.n=2"]).actor_rollout_ref.rollout.n == 2  # 12 responses split over 4


def test_data_parallel_size_accounts_for_megatron_model_parallelism():
    base = ["trainer.n_gpus_per_node=8", "data.train_batch_size=6", f"{ACTOR}.ppo_mini_batch_size=6", f"{ACTOR}.strategy=megatron",
            "algorithm.adv_estimator=grpo"]
    assert "8 data-parallel ranks" in error_of(base)
    cfg = load_config(base + [f"{ACTOR}.megatron.tensor_model_parallel_size=2", f"{ACTOR}.megatron.pipeline_model_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size == 2  # 6 responses over 2 ranks


def test_micro_batch_must_divide_the_per_gpu_mini_batch():
    base = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8"]
    message = error_of(base + [f"{ACTOR}.ppo_micro_batch_size_per_gpu=3"])
    assert f"{ACTOR}.ppo_micro_batch_size_per_gpu=3 does not divide the per-GPU mini-batch of 4 responses" in message
    assert "use one of [1, 2, 4]" in message
    assert load_config(base + [f"{ACTOR}.ppo_micro_batch_size_per_gpu=3", f"{ACTOR}.use_dynamic_bsz=true"])  # token-based batching


def test_critic_batch_arithmetic_is_checked_when_the_critic_trains():
    base = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=3"]
    assert "critic.ppo_micro_batch_size_per_gpu=3 does not divide" in error_of(base + ["algorithm.adv_estimator=gae"])
    assert load_config(base + ["algorithm.adv_estimator=grpo"]).critic.enable is False


def test_megatron_sizes_must_divide_the_gpus():
    base = ["trainer.n_gpus_per_node=8", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8", f"{ACTOR}.strategy=megatron"]
    message = error_of(base + [f"{ACTOR}.megatron.tensor_model_parallel_size=3"])
    assert "tensor × pipeline × context parallel size = 3 × 1 × 1 = 3 does not divide the 8 GPUs" in message
    message = error_of(base + [f"{ACTOR}.megatron.expert_model_parallel_size=16"])
    assert "expert tensor × expert model × pipeline parallel size = 1 × 16 × 1 = 16 does not divide the 8 GPUs" in message
    message = error_of(base + [f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size=2"])
    assert "needs actor_rollout_ref.actor.megatron.pipeline_model_parallel_size > 1" in message


def test_rollout_tensor_parallel_size_must_divide_the_gpus():
    message = error_of(["trainer.n_gpus_per_node=8", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8",
                        f"{ROLLOUT}.tensor_model_parallel_size=3"])
    assert f"{ROLLOUT}.tensor_model_parallel_size=3 does not divide the 8 GPUs (trainer.nnodes × trainer.n_gpus_per_node = 1 × 8); use one of [1, 2, 4]" in message


def test_settings_that_need_another():
    assert "algorithm.adv_estimator=gae needs a critic but critic.enable=false" in error_of(["critic.enable=false"])
    assert "needs trainer.resume_from_path" in error_of(["trainer.resume_mode=resume_path"])
    assert "needs reward_model.model.path" in error_of(["reward_model.enable=true"])
    assert "max_model_len=600 is shorter than prompt_length + response_length = 512 + 512" in error_of([f"{ROLLOUT}.max_model_len=600"])


def test_all_problems_are_reported_together():
    message = error_of([f"{ROLLOUT}.top_p=2", "data.max_prompt_length=0"])
    assert message.startswith("invalid configuration:")
    assert "top_p=2.0" in message and "data.max_prompt_length=0" in message


def test_deprecated_global_micro_batch_becomes_per_gpu():
    base = ["trainer.n_gpus_per_node=8", "data.train_batch_size=64", f"{ACTOR}.ppo_mini_batch_size=64"]
    cfg = load_config(base + [f"{ACTOR}.ppo_micro_batch_size=16", "actor_rollout_ref.ref.log_prob_micro_batch_size=32"])
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size == 16  # the user's value stays as given
    message = error_of(base + [f"{ACTOR}.ppo_micro_batch_size=16", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"])
    assert "ppo_micro_batch_size is deprecated, so remove it" in message


def test_warmup_style_is_the_old_name_of_the_scheduler_type():
    assert load_config([f"{ACTOR}.optim.warmup_style=cosine"]).actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert "contradicts" in error_of([f"{ACTOR}.optim.warmup_style=constant", f"{ACTOR}.optim.lr_scheduler_type=cosine"])


def test_critic_enable_follows_the_estimator_unless_set():
    assert load_config(["algorithm.adv_estimator=gae"]).critic.enable is True
    assert load_config(["algorithm.adv_estimator=rloo"]).critic.enable is False
    assert load_config(["algorithm.adv_estimator=rloo", "critic.enable=true"]).critic.enable is True


def test_resource_pools_must_fit_the_nodes_and_name_known_roles():
    base = ["trainer.n_gpus_per_node=8", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8"]
    cfg = load_config(base + ["resource_pool.pools={train: [4], critic: [4]}", "resource_pool.mapping={actor_rollout: train, critic: critic}"])
    assert cfg.resource_pool.pools == {"train": [4], "critic": [4]}
    assert "train 6 + critic 4 = 10 GPUs but the run has 8" in error_of(base + ["resource_pool.pools={train: [6], critic: [4]}"])
    assert "names no role" in error_of(base + ["resource_pool.pools={train: [4]}", "resource_pool.mapping={actr: train}"])
    assert "names no pool" in error_of(base + ["resource_pool.pools={train: [4]}", "resource_pool.mapping={critic: other}"])
    assert "must list a GPU count for each of the 1 node(s)" in error_of(base + ["resource_pool.pools={train: [4, 4]}"])


def test_the_hf_rollout_refuses_an_actor_under_the_cpu_offload_policy():
    message = error_of(["actor_rollout_ref.rollout.name=hf", f"{ACTOR}.fsdp_config.offload_policy=True"])
    assert "rollout.name=hf" in message and "use actor_rollout_ref.rollout.name=ember" in message
    load_config(["actor_rollout_ref.rollout.name=ember", f"{ACTOR}.fsdp_config.offload_policy=True"])


def test_every_loss_aggregation_mode_of_the_algorithms_is_accepted():
    from typing import get_args

    from ember.algorithms import LOSS_AGG_MODES
    from ember.config.schema.actor import LossAggMode

    assert get_args(LossAggMode) == LOSS_AGG_MODES
    cfg = load_config([f"{ACTOR}.loss_agg_mode=token-sum"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == cfg.critic.loss_agg_mode == "token-sum"
