"""The keys of a rollout pool apart from the trainer's, of one-step-off-policy training (verl's
one_step_off_policy recipe) and of fully asynchronous training (verl's fully_async_policy keys: those
ember honours, and those it refuses by name), and the generation plan they make."""

import pytest
import torch

from ember.config import ConfigError, load_config
from ember.config.features import unimplemented_features
from ember.config.placement import plan_placement
from ember.trainer.generation_queue import GenerationPlan

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
    (["async_training.mode=fully_async"], "async_training.mode=fully_async generates on GPUs of its own"),
    (["async_training.mode=fully_sync"], "async_training.mode=fully_sync is not a mode; choose one of sync, one_step_off, "
                                         "fully_async"),
    (["async_training.staleness_threshold=0.5"], "async_training.staleness_threshold=0.5 applies to "
                                                 "async_training.mode=fully_async only (the mode is sync)"),
    ([*SPLIT, "async_training.mode=fully_async", "async_training.require_batches=2"],
     "async_training.require_batches=2: ember's step trains data.train_batch_size prompts"),
    ([*SPLIT, "async_training.mode=fully_async", "async_training.trigger_parameter_sync_step=0"],
     "async_training.trigger_parameter_sync_step=0: give 1 or more"),
    ([*SPLIT, "async_training.mode=fully_async", "async_training.staleness_threshold=-1"],
     "async_training.staleness_threshold=-1.0: give 0 or more"),
    (["+async_training.use_rollout_log_probs=true"], "algorithm.rollout_correction.bypass_mode=true in ember"),
    (["+async_training.compute_prox_log_prob=true"], "a proximal log-prob forward is not built"),
    ([*SPLIT, "rollout.n_gpus_per_node=0"], "rollout.n_gpus_per_node=0: actor_rollout_ref.hybrid_engine=false puts"),
    ([*SPLIT, "rollout.n_gpus_per_node=3", f"{A}.rollout.tensor_model_parallel_size=2"],
     f"{A}.rollout.tensor_model_parallel_size=2 does not divide the rollout pool's GPUs"),
    (["+rollout.total_rollout_steps=100"], "ember's async_training.mode=fully_async generates whole steps' batches"),
])
def test_bad_async_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    assert message in str(error.value)


def test_weight_sync_with_ray_is_accepted_and_named_as_without_effect(caplog):
    load_config([*SPLIT, "+trainer.weight_sync_with_ray=false"])
    assert "trainer.weight_sync_with_ray=False" in caplog.text and "whatever this says" in caplog.text


def test_verl_fully_async_config_name_sets_the_mode_and_its_keys_make_the_plan():
    cfg = load_config([*SPLIT[1:], "async_training.staleness_threshold=0.1", "async_training.trigger_parameter_sync_step=4",
                       "+async_training.checkpoint_engine.enable=true"], config_name="fully_async_ppo_trainer")
    assert cfg.async_training.mode == "fully_async" and not cfg.actor_rollout_ref.hybrid_engine
    assert unimplemented_features(cfg) == []
    # verl's fraction 0.1 is one whole step ahead; weights synced every 4 updates lag up to 3 more, so a batch is
    # at most 4 updates behind on schedule: none of verl's script's generations is dropped for the sync interval
    plan = GenerationPlan.of(cfg.async_training)
    assert (plan.steps_ahead, plan.sync_every, plan.max_staleness) == (1, 4, 4)
    assert plan.sync_due(4, None) and plan.sync_due(4, 0) and not plan.sync_due(3, 0)
    assert not plan.too_stale(torch.tensor([7, 3]), 7) and plan.too_stale(torch.tensor([7, 2]), 7)
    one_step_off = GenerationPlan.of(load_config([*SPLIT, "async_training.mode=one_step_off"]).async_training)
    assert (one_step_off.steps_ahead, one_step_off.sync_every, one_step_off.max_staleness) == (1, 1, None)
    assert GenerationPlan.of(load_config([]).async_training).steps_ahead == 0


def test_partial_rollout_is_refused_by_name_with_the_reason():
    cfg = load_config([*SPLIT, "async_training.mode=fully_async", "async_training.partial_rollout=true"])
    assert any("async_training.partial_rollout=true" in message and "finishes with the weights it started with"
               in message for message in unimplemented_features(cfg))
