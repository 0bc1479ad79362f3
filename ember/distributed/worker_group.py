"""Worker groups: the processes of one resource pool, in the driver's process or one Ray actor per GPU.

A group holds one worker object per rank of its pool, built by a factory the caller names
(the factory and its arguments are pickled to Ray workers, so both must be importable).
The driver never sees ranks: `run_all` calls a method on every rank, `run_each` gives each
rank its own arguments (a batch's data-parallel share), and both return results in rank
order. `start_*` return a pending call, so two pools on separate GPUs work at the same time.

The one thing to know: every Ray worker is a torch.distributed rank of its pool. RANK,
WORLD_SIZE, MASTER_ADDR/PORT are set before the worker object is built, LOCAL_RANK is 0
because Ray shows each worker only its own GPU, so engines join the pool's process group
exactly as under torchrun. A worker that raises fails the call with its rank and traceback;
a worker process that dies fails it naming the rank; neither leaves the driver waiting.
`LocalWorkerGroup` is the same surface over one object in the driver's process (one
device, no Ray).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.config.placement import Pool
from ember.distributed.weight_transfer import rendezvous_address
from ember.errors import UserError


class WorkerError(RuntimeError):
    """A call on a worker failed: the message names the pool, the rank and the method, then the worker's traceback.
    `cause`: the exception the worker raised (None when its process died)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class Pending:
    """A call started on every rank of a group; `wait()` returns the results in rank order."""

    def __init__(self, wait: Callable[[], list[Any]]):
        self._wait = wait

    def wait(self) -> list[Any]:
        return self._wait()


class LocalWorkerGroup:
    """One worker object in the driver's process: a pool of one rank without Ray."""

    world_size = 1

    def __init__(self, factory: Callable[..., Any], *args: Any, name: str = "local", **kwargs: Any):
        self.name = name
        self.worker = factory(*args, **kwargs)

    def start_all(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        result = [getattr(self.worker, method)(*args, **kwargs)]
        return Pending(lambda: result)

    def start_each(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> Pending:
        (args, kwargs), = per_rank
        return self.start_all(method, *args, **kwargs)

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.start_all(method, *args, **kwargs).wait()

    def run_each(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        return self.start_each(method, per_rank).wait()

    def shutdown(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


class _RankHost:
    """The Ray actor around one worker object: sets the rank's environment, then builds and calls it."""

    def __init__(self, environment: dict[str, str]):
        os.environ.update(environment)
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for the pool's torch.distributed store (asked of rank 0)."""
        return rendezvous_address()

    def build(self, environment: dict[str, str], factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        os.environ.update(environment)
        self.worker = factory(*args, **kwargs)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


@dataclass(frozen=True)
class RayOptions:
    """How a pool's workers are placed: CPUs each, whether each takes a GPU, environment they start with."""

    cpus_per_worker: float = 1.0
    use_gpus: bool = True
    environment: dict[str, str] | None = None
    death_timeout_s: float = 60.0  # how long a call waits on a rank whose process is gone before failing


class RayWorkerGroup:
    """One Ray actor per GPU (or CPU worker) of `pool`, each a torch.distributed rank; see the module docstring."""

    def __init__(self, pool: Pool, factory: Callable[..., Any], *args: Any, options: RayOptions = RayOptions(),
                 **kwargs: Any):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = pool.name
        self.world_size = pool.size
        bundle = {"CPU": options.cpus_per_worker, **({"GPU": 1} if options.use_gpus else {})}
        # One placement group per node, packed: a node's ranks share a machine (and its NVLink), as under torchrun.
        self._placement_groups = [placement_group([bundle] * pool.gpus_per_node, strategy="STRICT_PACK")
                                  for _ in range(pool.nnodes)]
        ray.get([group.ready() for group in self._placement_groups])
        host = ray.remote(_RankHost)
        base_environment = dict(options.environment or {})
        self._hosts = []
        for rank in range(pool.size):
            group = self._placement_groups[rank // pool.gpus_per_node]
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank % pool.gpus_per_node)
            self._hosts.append(host.options(num_cpus=options.cpus_per_worker, num_gpus=1 if options.use_gpus else 0,
                                            scheduling_strategy=strategy).remote(base_environment))
        self._death_timeout_s = options.death_timeout_s
        master_address, master_port = self._gather(ray, [self._hosts[0].rendezvous_address.remote()], "start")[0]
        builds = []
        for rank, host_actor in enumerate(self._hosts):
            environment = {"RANK": str(rank), "WORLD_SIZE": str(pool.size), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": str(pool.gpus_per_node), "MASTER_ADDR": master_address,
                           "MASTER_PORT": str(master_port)}
            builds.append(host_actor.build.remote(environment, factory, args, kwargs))
        self._building: Pending | None = Pending(lambda: self._gather(ray, builds, "build"))

    def wait_until_built(self) -> None:
        """Wait for every rank's worker object (the builds run from `__init__` on, so pools on separate GPUs
        build at the same time); the first call on the group waits for them too. A failed build raises here."""
        if self._building is not None:
            building, self._building = self._building, None
            building.wait()

    def start_all(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        return self.start_each(method, [(args, kwargs)] * self.world_size)

    def start_each(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> Pending:
        import ray

        self.wait_until_built()
        if len(per_rank) != self.world_size:
            raise ValueError(f"{self.name}.{method}: {len(per_rank)} argument sets for {self.world_size} ranks")
        futures = [host.call.remote(method, args, kwargs) for host, (args, kwargs) in zip(self._hosts, per_rank)]
        return Pending(lambda: self._gather(ray, futures, method))

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.start_all(method, *args, **kwargs).wait()

    def run_each(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        return self.start_each(method, per_rank).wait()

    def _gather(self, ray, futures: list, method: str) -> list[Any]:
        """Results in rank order; the first failure (an exception, or a dead process) raises WorkerError."""
        remaining = list(futures)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1)
            self._result(ray, ready[0], futures.index(ready[0]), method)
        return [self._result(ray, future, rank, method) for rank, future in enumerate(futures)]

    def _result(self, ray, future, rank: int, method: str) -> Any:
        try:
            return ray.get(future, timeout=self._death_timeout_s)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, UserError):  # what the user gave, found by a worker: no traceback
                raise UserError(f"{error.cause} ({self.name} rank {rank}, in {method})") from None
            raise WorkerError(f"{self.name} rank {rank} failed in {method}:\n{error}", cause=error.cause) from None
        except ray.exceptions.RayActorError as error:
            raise WorkerError(f"{self.name} rank {rank}: its worker process died during {method} "
                              f"({type(error).__name__})") from None

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for host in self._hosts:
            ray.kill(host)
        for group in self._placement_groups:
            remove_placement_group(group)
