"""verl keys ember accepts but replaces with its own behaviour: their descriptions say so, or the run warns."""

import logging

import pytest

from ember.config import load_config
from ember.config.describe import describe_keys
from ember.config.schema import EmberConfig
from ember.trainer.rl_setup import warn_overridden_settings

ACTOR = "actor_rollout_ref.actor"


@pytest.mark.parametrize("key", [
    f"{ACTOR}.optim.total_training_steps",
    "critic.optim.total_training_steps",
    "data.dataloader_num_workers",
    "data.filter_overlong_prompts_workers",
    "actor_rollout_ref.rollout.data_parallel_size",
    "resource_pool.actor_rollout.num_cpus",
    "resource_pool.critic.num_cpus",
    "ray_kwargs.resource_pool",
])
def test_keys_without_effect_say_so(key):
    line, = [line for line in describe_keys(EmberConfig, key).splitlines() if line.startswith(key + " ")]
    assert "(no effect" in line


def test_optimizer_total_steps_that_disagree_with_the_run_are_reported(caplog):
    cfg = load_config([f"{ACTOR}.optim.total_training_steps=500", "critic.enable=true",
                       "critic.optim.total_training_steps=120"])
    with caplog.at_level(logging.WARNING, logger="ember.trainer.rl_setup"):
        warn_overridden_settings(cfg, total_steps=120)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert f"{ACTOR}.optim.total_training_steps=500 is ignored" in message and "the run's 120 steps" in message


def test_the_default_optimizer_total_steps_and_checkpoint_contents_are_quiet(caplog):
    with caplog.at_level(logging.WARNING, logger="ember.trainer.rl_setup"):
        warn_overridden_settings(load_config([]), total_steps=120)
    assert caplog.records == []


def test_a_checkpoint_without_the_optimizer_is_reported(caplog):
    cfg = load_config([f"{ACTOR}.checkpoint.save_contents=[model,extra]"])
    with caplog.at_level(logging.WARNING, logger="ember.trainer.rl_setup"):
        warn_overridden_settings(cfg, total_steps=10)
    message, = [record.getMessage() for record in caplog.records]
    assert f"{ACTOR}.checkpoint.save_contents=['model', 'extra'] leaves out optimizer" in message
    assert "saves the optimizer state anyway" in message


def test_bypass_mode_with_gspo_says_that_verl_would_train_vanilla_ppo(caplog):
    cfg = load_config(["algorithm.rollout_correction.bypass_mode=true", f"{ACTOR}.policy_loss.loss_mode=gspo"])
    with caplog.at_level(logging.WARNING, logger="ember.trainer.rl_setup"):
        warn_overridden_settings(cfg, total_steps=10)
    message, = [record.getMessage() for record in caplog.records]
    assert "loss_mode=gspo: ember trains with gspo" in message and "token-level PPO (vanilla)" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ember.trainer.rl_setup"):
        warn_overridden_settings(load_config(["algorithm.rollout_correction.bypass_mode=true"]), total_steps=10)
    assert caplog.records == []  # vanilla PPO: the same loss in both
