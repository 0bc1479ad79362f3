"""Resource pools in both forms users write: shared, split, and every layout that does not fit."""

import pytest

from ember.config import ConfigError, load_config
from ember.config.placement import plan_placement

ACTOR = "actor_rollout_ref.actor"
EIGHT = ["trainer.n_gpus_per_node=8", "data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8"]
SIXTEEN = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "data.train_batch_size=48", f"{ACTOR}.ppo_mini_batch_size=48"]


def error_of(overrides):
    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    return str(error.value)


def test_no_pools_is_one_pool_of_every_gpu():
    placement = plan_placement(load_config(SIXTEEN))
    assert [(pool.gpus_per_node, pool.nnodes) for pool in placement.pools] == [(8, 2)]
    assert not placement.split and placement.pool_of("critic").size == 16


def test_pools_adding_up_to_the_run_split_it_in_the_order_written():
    for pools in (["resource_pool.pools={train: [4], critic: [4]}", "resource_pool.mapping={critic: critic}"],
                  ["+resource_pool.critic.num_gpus=4", "+resource_pool.actor_rollout.num_gpus=4"]):
        placement = plan_placement(load_config(EIGHT + pools))
        assert placement.split
        actor, critic = placement.pool_of("actor_rollout"), placement.pool_of("critic")
        assert (actor.first_gpu, actor.size, critic.first_gpu, critic.size) == (0, 4, 4, 4)
        assert placement.pool_of("ref") == actor and not placement.colocated("actor_rollout", "critic")


def test_pools_that_each_ask_for_every_gpu_are_shared():
    placement = plan_placement(load_config(["trainer.n_gpus_per_node=2", "+resource_pool.actor_rollout.num_gpus=2",
                                            "+resource_pool.critic.num_gpus=2"]))
    assert not placement.split and placement.colocated("actor_rollout", "critic")
    assert {pool.first_gpu for pool in placement.pools} == {0}


def test_pools_across_nodes_take_the_same_gpus_on_each_node():
    placement = plan_placement(load_config(SIXTEEN + [
        "resource_pool.pools={train: [6, 6], critic: [2, 2]}", "resource_pool.mapping={critic: critic}"]))
    assert [(pool.first_gpu, pool.gpus_per_node, pool.size) for pool in placement.pools] == [(0, 6, 12), (6, 2, 4)]


@pytest.mark.parametrize("overrides, expected", [
    (["+resource_pool.actor_rollout.num_gpus=6", "+resource_pool.critic.num_gpus=4"],
     "resource_pool asks for actor_rollout 6 + critic 4 = 10 GPUs but the run has 8 GPUs"),
    (["+resource_pool.actor_rollout.num_gpus=4", "+resource_pool.critic.num_gpus=2"],
     "must add up to 8, or each ask for all 8 to share them"),
    (["+resource_pool.actor_rollout.num_gpus=8", "+resource_pool.critic.num_gpus=0"],
     "resource_pool.critic.num_gpus=0 asks for no GPUs"),
    (["+resource_pool.actor_rollout.num_gpus=16"], "resource_pool.actor_rollout.num_gpus=16 asks for 16 GPUs but the run has 8"),
    (["trainer.nnodes=2", "+resource_pool.actor_rollout.num_gpus=9", "+resource_pool.critic.num_gpus=7"],
     "resource_pool.actor_rollout.num_gpus=9 does not split evenly over the 2 nodes"),
    (["trainer.nnodes=2", "resource_pool.pools={train: [6, 2], critic: [2, 6]}"],
     "resource_pool.pools.train=[6, 2] does not split evenly over the 2 nodes"),
    (["+resource_pool.critic.num_gpus=8"], "but not for actor_rollout"),
    (["resource_pool.pools={train: [8]}", "+resource_pool.critic.num_gpus=8"], "not both"),
    (["+resource_pool.actor_rollout.num_gpus=6", "+resource_pool.critic.num_gpus=2",
      f"{ACTOR}.strategy=megatron", f"{ACTOR}.megatron.tensor_model_parallel_size=4"],
     "does not divide the 6 GPUs of its resource pool"),
    (["+resource_pool.actor_rollout.num_gpus=6", "+resource_pool.critic.num_gpus=2",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     "rollout.tensor_model_parallel_size=4 does not divide the 6 GPUs of its resource pool"),
])
def test_layouts_that_do_not_fit_name_the_pools_and_the_run(overrides, expected):
    assert expected in error_of(EIGHT + overrides)


def test_a_mini_batch_splits_over_the_ranks_of_its_own_pool():
    split = ["+resource_pool.actor_rollout.num_gpus=6", "+resource_pool.critic.num_gpus=2"]
    message = error_of(EIGHT + split + ["data.train_batch_size=4", f"{ACTOR}.ppo_mini_batch_size=4",
                                         "actor_rollout_ref.rollout.n=1"])
    assert "cannot be split evenly over 6 data-parallel ranks" in message
