"""A rollout pool of its own runs one call at a time, so a weight sync is queued behind the generations already
sent to it. The sync must wait for them before the actor's side opens the weight group's broadcast: a broadcast
held open for a whole generation outlasts the group's timeout on long answers (`nccl_timeout`) and ends the run."""

from __future__ import annotations

from ember.distributed.worker_group import Pending
from ember.engines.base import DataLayout
from ember.trainer.role_groups import RolloutGroup, WeightSenderGroup


class QueuedPool:
    """A pool that runs the calls sent to it in order, each once its caller waits for it (or for a later one), and
    logs each call as it runs; `rollout`, if set, is the pool whose queue the actor's `send` sees as it opens."""

    def __init__(self, name: str, log: list[str], rollout: QueuedPool | None = None):
        self.name, self.log, self.rollout, self.world_size = name, log, rollout, 1
        self.queue: list[str] = []

    def start_all(self, _call: str, _role: str, method: str, *args):
        if method == "send":
            self.log.append(f"send opened, the rollout's queue: {self.rollout.queue}")
        self.queue.append(method)

        def run():
            while method in self.queue:
                self.log.append(f"{self.name}.{self.queue.pop(0)}")
            return [RESULTS.get(method)]

        return Pending(run)


RESULTS = {"data_layout": DataLayout(dp_size=1, dp_rank=0), "address": ("127.0.0.1", 1), "tensor_specs": [],
           "send": {"seconds": 0.1, "bytes": 1 << 20}, "receive_weights": 7}


def test_a_sync_opens_the_broadcast_only_once_the_rollouts_queued_generation_has_run():
    log: list[str] = []
    rollout_pool = QueuedPool("rollout", log)
    rollout = RolloutGroup(rollout_pool, sender=WeightSenderGroup(QueuedPool("actor", log, rollout=rollout_pool)))
    generating = rollout._start_all("generate")  # a generation in flight (one-step-off's next step)
    log.clear()
    assert rollout.sync_weights(7) == {"seconds": 0.1, "gb": 1 / 1024}
    assert log.index("rollout.generate") < log.index("send opened, the rollout's queue: []"), log
    assert rollout.synced_version == 7 and rollout.sync_weights(7) == {}  # held already: nothing sent
    generating.wait()
