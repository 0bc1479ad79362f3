"""`async_training`: whether generation waits for the update before it (verl's recipes as one key).

verl chooses its asynchronous loops by entry point (`recipe.one_step_off_policy.main_ppo`,
`recipe.fully_async_policy.fully_async_main`); ember has one `ember train`, so the loop is this
section's `mode`, which the built-in bases `one_step_off_ppo_trainer` and `fully_async_ppo_trainer`
(verl's config names) set. The one thing to know about `fully_async`: ember generates whole steps'
batches ahead, not single samples, so verl's `staleness_threshold` (a fraction of extra samples per
weight sync) is read as a count of steps, rounded up (`trainer/generation_queue.py`).
"""

from dataclasses import dataclass

from ember.config.schema.base import field_

ASYNC_MODES = ("sync", "one_step_off", "fully_async")


@dataclass
class AsyncTrainingConfig:
    """How generation and training overlap."""

    mode: str = field_(
        "sync", "sync: each step generates with the weights of the step before it; one_step_off (verl's "
                "one_step_off_policy, needs actor_rollout_ref.hybrid_engine=false): step k+1's samples are generated "
                "while step k trains, with the weights of step k-1 (one update behind); fully_async (verl's "
                "fully_async_policy, hybrid_engine=false): generation runs up to ceil(staleness_threshold) steps "
                "ahead, weights synced every trigger_parameter_sync_step updates, samples further behind than the two "
                "allow dropped and generated again")
    staleness_threshold: float = field_(
        1.0, "fully_async: how many steps generation runs ahead (rounded up: 0.1 = 1); a sample's weights are then at "
             "most that many updates behind the weights that train on it, plus trigger_parameter_sync_step - 1; "
             "0 generates each step when it trains")
    trigger_parameter_sync_step: int = field_(
        1, "fully_async: the rollout gets the actor's weights every this many updates (in between it generates "
           "with the weights it has)")
    require_batches: int = field_(
        1, "fully_async: ppo_mini_batch_size batches per update in verl; ember's step trains data.train_batch_size "
           "prompts, so only 1 is accepted")
    partial_rollout: bool = field_(
        False, "fully_async: interrupt generations at a weight sync and continue them with the new weights "
               "(not built: a generation finishes with the weights it started with)")
