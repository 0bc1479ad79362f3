"""`async_training`: whether generation waits for the update before it (verl's recipes as one key).

verl chooses its asynchronous loops by entry point (`recipe.one_step_off_policy.main_ppo`,
`recipe.fully_async_policy.fully_async_main`); ember has one `ember train`, so the loop is this
section's `mode`, which the built-in base `one_step_off_ppo_trainer` (verl's config name) sets.
verl's fully-async keys of this section are refused (`config/verl_keys.py`): that loop is not built.
"""

from dataclasses import dataclass

from ember.config.schema.base import field_

ASYNC_MODES = ("sync", "one_step_off")


@dataclass
class AsyncTrainingConfig:
    """How generation and training overlap."""

    mode: str = field_("sync", "sync: each step generates with the weights of the step before it; one_step_off (verl's "
                               "one_step_off_policy, needs actor_rollout_ref.hybrid_engine=false): step k+1's samples are "
                               "generated while step k trains, with the weights of step k-1 (one update behind)")
