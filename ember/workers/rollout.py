"""The rollout role on one rank: a generation engine that always generates with the actor's
current weights.

The one thing to know: an engine with its own copy of the weights (`rollout.name=ember`) is
sent the actor's full weights, streamed in buckets, whenever the actor has updated since the
last sync (`Actor.updates`); after the first sync only the weights training changes (with LoRA,
the adapted layers with their adapters merged in: `named_parameters_for_sync(trained_only=True)`); gathering them is a collective, so every rank of the actor's
pool generates at once. An engine that generates with the actor's own module (`hf`, or
ember's engine sharing the actor's tensors at one rank) needs no sync; the `hf` engine holds
the actor resident while it generates. With `rollout.free_cache_engine` the engine's KV
cache goes back to training after each generation (`sleep`) and is taken again on the next.
With noise injection (`noise_injection.py`) the weights are noised on their way to the engine
for training steps (`use_noise(step)`) and sent clean for validation (`use_noise(None)`): the
synced state records which, so each switch sends the weights again.

With `actor_rollout_ref.hybrid_engine=false` there is no actor beside it (`actor=None`): the rollout
ranks form a pool of their own and the weights arrive when the driver has the actor's ranks send
them (`receive_weights`, the other end of `workers/weight_sync.py`; the same weights as beside the
actor: every one at the first sync, then those training changes). Either way every sample
carries the version of the weights that generated it (`RolloutOutput.policy_version`).
"""

from __future__ import annotations

import contextlib

from ember.agent import AgentLoop
from ember.distributed.device import rank, world_size
from ember.distributed.weight_transfer import SyncSpecs, WeightTransfer
from ember.engines.base import DataLayout
from ember.profiling import phase
from ember.rollout import Injection, RolloutEngine, RolloutOutput, SamplingParams
from ember.workers.actor import Actor
from ember.workers.noise_injection import NoiseInjection


class PolicyRollout:
    """Generation with the actor's current weights; see the module docstring."""

    def __init__(self, rollout: RolloutEngine, actor: Actor | None, free_cache_engine: bool,
                 noise: NoiseInjection | None = None, weight_timeout_s: float = 600.0,
                 agent_loop: AgentLoop | None = None):
        if noise is not None and rollout.shares_training_weights:
            raise ValueError("noise injection needs a rollout engine with its own copy of the weights "
                             "(rollout.name=ember), not one that generates with the actor's module")
        self.rollout = rollout
        self.agent_loop = agent_loop
        """rollout.multi_turn: the agent loop that generates on `rollout`'s engine instead of its `generate`."""
        self.actor = actor
        self.free_cache_engine = free_cache_engine
        self.noise = noise
        self.noise_step: int | None = None  # the training step whose noise to send; None: clean weights
        self.synced_updates: int | None = None
        self.synced_noise_step: int | None = None
        self.asleep = False
        self.policy_version = 0  # the version of the weights the engine holds (see `Actor.version`)
        self.weight_timeout_s = weight_timeout_s
        self.transfer: WeightTransfer | None = None  # without an actor: the weight group's receiving end
        self.specs = SyncSpecs([], [])

    def data_layout(self) -> DataLayout:
        """The generation engine's own layout, whatever the actor's training layout: each replica (one
        rank, or `rollout.tensor_model_parallel_size` consecutive ranks splitting one engine) generates
        its own share of the prompts, and the replica's first rank returns the samples."""
        size = self.rollout.tensor_parallel_size
        return DataLayout(world_size() // size, rank() // size, rank() % size == 0)

    def use_noise(self, step: int | None) -> None:
        """Generate with the noise of training step `step` from now on, or with clean weights (None)."""
        self.noise_step = step if self.noise is not None else None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections: list[Injection | None] | None = None,
                 extra_infos: list[dict] | None = None) -> list[RolloutOutput]:
        """Responses to `prompts` (this rank's share, possibly none: the weight sync still takes part);
        NLA's `injections`, one per prompt, go to the engine with them. With an agent loop the samples are
        multi-turn trajectories, and `extra_infos` (one per prompt) carry their tools' `tools_kwargs`."""
        self.prepare()
        if not prompts:
            return []
        if self.agent_loop is not None:
            if injections is not None and any(injection is not None for injection in injections):
                raise ValueError("multi-turn rollouts do not inject vectors (NLA); turn off rollout.multi_turn")
            outputs = self.agent_loop.generate(prompts, sampling, extra_infos)
        else:
            with self._generating():
                outputs = self.rollout.generate(prompts, sampling, injections)
        for output in outputs:
            output.policy_version = self.policy_version
        return outputs

    def connect_weights(self, address: str, port: int, group_size: int, specs: SyncSpecs) -> None:
        """Join the weight group (the actor's first rank is its rank 0, this rank 1 + its rollout rank) and keep
        the names and shapes the syncs send (a rollout pool of its own only)."""
        self.specs = specs
        self.transfer = WeightTransfer(address, port, 1 + rank(), group_size, self.weight_timeout_s)

    def idle(self) -> None:
        """Nothing: it returns once the calls sent before it have run (a weight sync waits for it)."""

    def receive_weights(self) -> int:
        """Take one sync of the actor's weights into the engine; the version received."""
        with phase("rollout/weight_receive"):
            self.policy_version = self.transfer.receive(self.specs, self.rollout.update_weights)
        return self.policy_version

    def sleep(self) -> None:
        """With rollout.free_cache_engine, hand the KV cache back for training until the next `generate`."""
        if self.free_cache_engine and not self.asleep:
            with phase("rollout/sleep"):
                self.rollout.sleep()
            self.asleep = True

    def prepare(self) -> None:
        """Awake and holding the actor's current weights (sent in buckets if the actor has changed since the last sync)."""
        if self.asleep:
            with phase("rollout/wake"):
                self.rollout.wake()
            self.asleep = False
        if self.actor is None:  # the weights arrive from the actor's pool (`receive_weights`)
            return
        stale = self.synced_updates != self.actor.updates or self.synced_noise_step != self.noise_step
        if not self.rollout.shares_training_weights and stale:
            # After the first sync only what training changes (with LoRA: the adapted layers, merged); noise is
            # drawn afresh for every weight at each step, so with noise every weight goes every time.
            trained_only = self.synced_updates is not None and self.noise is None
            with phase("rollout/weight_sync"), self.actor.engine.resident():
                for bucket in self.actor.engine.named_parameters_for_sync(trained_only=trained_only):
                    if self.noise_step is not None:
                        bucket = self.noise.apply(bucket, self.noise_step)
                    self.rollout.update_weights(bucket)
            self.synced_updates, self.synced_noise_step = self.actor.updates, self.noise_step
        self.policy_version = self.actor.version

    def _generating(self):
        if self.rollout.shares_training_weights:
            return self.actor.engine.resident()
        return contextlib.nullcontext()
