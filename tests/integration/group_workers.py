"""Worker objects for the worker-group tests; Ray workers import them by module name."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ember.distributed.device import init_distributed


class SumWorker:
    """Joins its pool's process group on build; sums a number over the ranks."""

    def __init__(self, offset: int, timeout_s: float | None = None):
        init_distributed(timeout_s)
        self.offset = offset

    def rank_and_world(self) -> tuple[int, int, str]:
        return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"]

    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value + self.offset], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor)

    def meet(self, directory: str, me: str, other: str, timeout_s: float) -> str:
        return meet(directory, me, other, timeout_s)

    def fail_on(self, rank: int) -> None:
        if dist.get_rank() == rank:
            raise ValueError(f"planted failure on rank {rank}")

    def die_on(self, rank: int) -> None:
        if dist.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)

    def all_reduce_without(self, rank: int) -> float:
        """An all-reduce that `rank` never joins: the others wait until the collective times out."""
        if dist.get_rank() == rank:
            return 0.0
        return self.all_reduce(1.0)


def meet(directory: str, me: str, other: str, timeout_s: float) -> str:
    """Says `me` has started (a file under `directory`), then waits until `other` has too; raises after `timeout_s`,
    so two calls that run one after the other never meet."""
    Path(directory, me).touch()
    deadline = time.monotonic() + timeout_s
    while not Path(directory, other).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{me} ran alone: {other} did not start within {timeout_s} s")
        time.sleep(0.05)
    return other


class MeetingBuildWorker:
    """Builds only once the pool named `other` has started its own build (`meet`): pools that build one after the
    other never meet, and the first one's build fails after `timeout_s`. Fails to build on `fail_rank`."""

    def __init__(self, directory: str, me: str, other: str | None, timeout_s: float = 60.0,
                 fail_rank: int | None = None):
        if int(os.environ["RANK"]) == fail_rank:
            raise ValueError(f"planted build failure on rank {fail_rank}")
        self.met = meet(directory, me, other, timeout_s) if other is not None else None

    def partner(self) -> str | None:
        return self.met
