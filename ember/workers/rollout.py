"""The rollout role on one rank: a generation engine that always generates with the actor's
current weights.

The one thing to know: an engine with its own copy of the weights (`rollout.name=ember`) is
sent the actor's full weights, streamed in buckets, whenever the actor has updated since the
last sync (`Actor.version`); gathering them is a collective, so every rank of the actor's
pool generates at once. An engine that generates with the actor's own module (`hf`, or
ember's engine sharing the actor's tensors at one rank) needs no sync; the `hf` engine holds
the actor resident while it generates. With `rollout.free_cache_engine` the engine's KV
cache goes back to training after each generation (`sleep`) and is taken again on the next.
"""

from __future__ import annotations

import contextlib

from ember.rollout import RolloutEngine, RolloutOutput, SamplingParams
from ember.workers.actor import Actor


class PolicyRollout:
    """Generation with the actor's current weights; see the module docstring."""

    def __init__(self, rollout: RolloutEngine, actor: Actor, free_cache_engine: bool):
        self.rollout = rollout
        self.actor = actor
        self.free_cache_engine = free_cache_engine
        self.synced_version: int | None = None
        self.asleep = False

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutOutput]:
        """Responses to `prompts` (this rank's share, possibly none: the weight sync still takes part)."""
        self.prepare()
        if not prompts:
            return []
        with self._generating():
            return self.rollout.generate(prompts, sampling)

    def sleep(self) -> None:
        """With rollout.free_cache_engine, hand the KV cache back for training until the next `generate`."""
        if self.free_cache_engine and not self.asleep:
            self.rollout.sleep()
            self.asleep = True

    def prepare(self) -> None:
        """Awake and holding the actor's current weights (sent in buckets if the actor has changed since the last sync)."""
        if self.asleep:
            self.rollout.wake()
            self.asleep = False
        if not self.rollout.shares_training_weights and self.synced_version != self.actor.version:
            with self.actor.engine.resident():
                for bucket in self.actor.engine.named_parameters_for_sync():
                    self.rollout.update_weights(bucket)
            self.synced_version = self.actor.version

    def _generating(self):
        if self.rollout.shares_training_weights:
            return self.actor.engine.resident()
        return contextlib.nullcontext()
