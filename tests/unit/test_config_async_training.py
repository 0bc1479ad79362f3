"""The keys of a rollout pool apart from the trainer's and of one-step-off-policy training (verl's
one_step_off_policy recipe), and verl's fully-async keys, which ember refuses."""

import pytest

from ember.config import ConfigError, load_config
from ember.config.features import unimplemented_features
from ember.config.placement import plan_placement

A = "actor_rollout_ref"
SPLIT = [f"{A}.hybrid_engine=false", f"{A}.rollout.name=ember", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=1"]


def test_verl_one_step_off_config_name_sets_the_mode_and_a_rollout_pool_after_the_trainers_gpus():
    cfg = load_config([f"{A}.rollout.name=ember", "trainer.n_gpus_per_node=4", "rollout.n_gpus_per_node=2"],
                      config_name="one_step_off_ppo_trainer")
    assert cfg.async_training.mode == "one_step_off" and not cfg.actor_rollout_ref.hybrid_engine
    placement = plan_placement(cfg)
    assert [(pool.name, pool.size, pool.first_gpu) for pool in placement.pools] == [("global", 4, 0), ("rollout", 2, 4)]
    assert placement.pool_of("rollout").name == "rollout" and placement.total_gpus == 6
    assert unimplemented_features(cfg) == []


def test_hybrid_engine_keeps_the_rollout_beside_the_actor():
    placement = plan_placement(load_config(["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=4"]))
    assert [pool.name for pool in placement.pools] == ["global"] and placement.total_gpus == 2


@pytest.mark.parametrize("overrides, message", [
    (["async_training.mode=one_step_off"], "async_training.mode=one_step_off generates on GPUs of its own while the "
                                           f"actor trains: set {A}.hybrid_engine=false"),
    (["async_training.mode=fully_async"], "async_training.mode=fully_async is not a mode; choose one of sync, one_step_off"),
    ([*SPLIT, "rollout.n_gpus_per_node=0"], "rollout.n_gpus_per_node=0: actor_rollout_ref.hybrid_engine=false puts"),
    ([*SPLIT, "rollout.n_gpus_per_node=3", f"{A}.rollout.tensor_model_parallel_size=2"],
     f"{A}.rollout.tensor_model_parallel_size=2 does not divide the rollout pool's GPUs"),
    (["+async_training.staleness_threshold=0.1"], "async_training.staleness_threshold=0.1 (in override "),
    (["+rollout.total_rollout_steps=100"], "verl's fully async trainer (recipe/fully_async_policy"),
])
def test_bad_async_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    assert message in str(error.value)


def test_weight_sync_with_ray_is_accepted_and_named_as_without_effect(caplog):
    load_config([*SPLIT, "+trainer.weight_sync_with_ray=false"])
    assert "trainer.weight_sync_with_ray=False" in caplog.text and "whatever this says" in caplog.text
