"""One-step-off-policy generation (`async_training.mode=one_step_off`, verl's one_step_off_policy recipe).

The rollout has its own pool (`hybrid_engine=false`). As soon as step k's samples are in, the
driver sends the rollout the actor's current weights (those of step k-1's update) and starts
generating step k+1's prompts, then scores and trains step k while they generate: the samples
of step k+1 are one update behind the weights that train on them (step 1 and step 2 both use the
weights loaded at the start). Each sample carries the version that generated it
(`Batch.policy_versions`), and rollout correction (`algorithm.rollout_correction`) applies to
the lag as to any other gap between the rollout's policy and the trainer's.

The one thing to know about checkpoints: a checkpoint written while a generation is in flight
records the data loader as it stood before that generation's prompts were taken, so a resume
generates those same prompts again (same seeds, with the checkpoint's weights, i.e. one update
fresher than the uninterrupted run used): no prompt is lost or trained twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.data.rl_dataset import PromptSample
from ember.distributed.worker_group import Pending
from ember.trainer.experience import Experience, build_experience


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
