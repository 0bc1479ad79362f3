"""Generation ahead of training: one-step-off-policy (`async_training.mode=one_step_off`, verl's
one_step_off_policy recipe) and fully asynchronous training with a staleness bound (`fully_async`,
verl's fully_async_policy keys), both on a rollout pool of its own (`hybrid_engine=false`).

The driver keeps up to `steps_ahead` generations started for later steps (`InFlightGeneration`, in
step order); the rollout's worker runs them one after another, each with the weights it holds when
it starts. one_step_off: as soon as step k's samples are in, the rollout is sent the actor's current
weights (step k-1's update) and starts on step k+1's prompts while step k trains, so samples are one
update behind. fully_async: generation runs B = ceil(`staleness_threshold`) steps ahead and the rollout gets
new weights only every T = `trigger_parameter_sync_step` updates, so a sample is at most B + T - 1 updates
behind the weights that train on it (a weight sync counts as verl's parameter version does: a generation
started between two syncs is not stale for it). The schedule keeps every batch within that bound; one past
it would be dropped (counted in `rollout/stale_dropped`) and generated again, after a sync, with the same
prompts and seeds. Each sample carries the version that generated it (`Batch.policy_versions`), and rollout correction
(`algorithm.rollout_correction`, bypass mode too) applies to the lag as to any other gap.

The one thing to know about checkpoints: a checkpoint written while generations are in flight
records the data loader as it stood before the first of them took its prompts, so a resume
generates those prompts again (same seeds, with the checkpoint's weights): no prompt is lost or
trained twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ember.config.schema.async_training import AsyncTrainingConfig
from ember.data.rl_dataset import PromptSample
from ember.distributed.worker_group import Pending
from ember.trainer.experience import Experience, build_experience


@dataclass(frozen=True)
class GenerationPlan:
    """How far generation runs ahead of training and how stale its samples may be."""

    steps_ahead: int  # generations started for later steps (0: each step generates when it trains)
    sync_every: int  # updates between weight syncs to the rollout
    max_staleness: int | None  # updates a sample may be behind the weights that train on it; None: unchecked

    @classmethod
    def of(cls, section: AsyncTrainingConfig) -> GenerationPlan:
        if section.mode == "one_step_off":
            return cls(steps_ahead=1, sync_every=1, max_staleness=None)  # one behind by construction
        if section.mode == "fully_async":
            ahead, sync_every = math.ceil(section.staleness_threshold), section.trigger_parameter_sync_step
            # weights held between syncs lag up to sync_every - 1 updates more: no batch is dropped for that alone
            return cls(steps_ahead=ahead, sync_every=sync_every, max_staleness=ahead + sync_every - 1)
        return cls(steps_ahead=0, sync_every=1, max_staleness=None)

    def sync_due(self, actor_version: int, synced_version: int | None) -> bool:
        """Whether a generation started now should first get the actor's weights."""
        return synced_version is None or actor_version - synced_version >= self.sync_every

    def too_stale(self, policy_versions: torch.Tensor | None, trained_version: int) -> bool:
        """Whether a batch's oldest sample is further behind `trained_version` than the bound."""
        if self.max_staleness is None or policy_versions is None:
            return False
        return trained_version - int(policy_versions.min()) > self.max_staleness


@dataclass
class InFlightGeneration:
    """A generation started for a later step than the one training."""

    step: int  # the step whose samples these are
    prompts: list[PromptSample]
    pending: Pending  # the rollout group's generation; `wait()` gives its outputs
    loader_state: dict  # the data loader before these prompts were taken (what a checkpoint records meanwhile)

    def experience(self, tokenizer, eos_token_ids: list[int]) -> Experience:
        """The finished generation as the step's experience (waits for it)."""
        return build_experience(self.prompts, self.pending.wait(), tokenizer, eos_token_ids, f"step{self.step}")
