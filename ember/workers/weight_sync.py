"""The actor's side of a rollout pool of its own (`actor_rollout_ref.hybrid_engine=false`).

Role "weight_sender" on every rank of the actor's pool. The one thing to know: every actor rank
takes part in each sync (the engine gathers each bucket over them), and the first rank alone
sends it on to the rollout ranks over the weight group (`distributed/weight_transfer.py`); the
rollout side is `PolicyRollout.receive_weights`. The first sync sends every weight, later ones only
those training changes (with LoRA the adapted layers, merged), as the rollout beside the actor gets
them. The version sent is the actor's (`Actor.version`: the training step whose update made the
weights), which the rollout stamps on every sample.
"""

from __future__ import annotations

from ember.distributed.device import rank
from ember.distributed.weight_transfer import SyncSpecs, TensorSpec, WeightTransfer, rendezvous_address
from ember.engines.base import DataLayout
from ember.profiling import phase
from ember.workers.actor import Actor


class WeightSender:
    """Streams the actor's weights to the rollout pool; see the module docstring."""

    def __init__(self, actor: Actor, timeout_s: float):
        self.actor = actor
        self.timeout_s = timeout_s
        self.transfer: WeightTransfer | None = None
        self.specs = SyncSpecs([], [])
        self.sent_once = False  # every rank counts the syncs alike: after the first, only the trained weights go

    def data_layout(self) -> DataLayout:
        """One share for the whole pool, returned by the first rank (the one that sends)."""
        return DataLayout(1, 0, rank() == 0)

    def address(self) -> tuple[str, int]:
        """Where the weight group's store is hosted: this node and a free port (asked of the first rank)."""
        return rendezvous_address()

    def tensor_specs(self) -> SyncSpecs:
        """The names, shapes and dtypes the syncs send, in order (a pass over the engine's buckets for each list
        that differs: every rank)."""
        engine = self.actor.engine

        def listed(trained_only: bool) -> list[TensorSpec]:
            return [TensorSpec.of(name, tensor) for bucket in engine.named_parameters_for_sync(trained_only=trained_only)
                    for name, tensor in bucket]

        with engine.resident():
            every = listed(False)
            self.specs = SyncSpecs(every, every if engine.trains_every_weight else listed(True))
        return self.specs

    def connect(self, address: str, port: int, group_size: int) -> None:
        """The first rank joins the weight group as its rank 0 (the rollout ranks join beside it)."""
        if rank() == 0:
            self.transfer = WeightTransfer(address, port, 0, group_size, self.timeout_s)

    def send(self) -> dict[str, float]:
        """One sync of the actor's current weights; on the first rank, bytes sent and seconds taken."""
        trained_only, self.sent_once = self.sent_once, True
        with phase("rollout/weight_send"), self.actor.engine.resident():
            buckets = self.actor.engine.named_parameters_for_sync(trained_only=trained_only)
            if self.transfer is None:  # gathers on the other ranks, sends nothing
                for _ in buckets:
                    pass
                return {}
            return self.transfer.send(buckets, self.specs, self.actor.version, trained_only)
