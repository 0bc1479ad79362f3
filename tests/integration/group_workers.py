"""Worker objects for the worker-group tests; Ray workers import them by module name."""

from __future__ import annotations

import os
import signal
import time

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

    def sleep_and_stamp(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

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


class SlowBuildWorker:
    """Takes `seconds` to build (as an engine's imports and model do) and remembers when; fails to build on
    `fail_rank`."""

    def __init__(self, seconds: float, fail_rank: int | None = None):
        start = time.time()
        if int(os.environ["RANK"]) == fail_rank:
            raise ValueError(f"planted build failure on rank {fail_rank}")
        time.sleep(seconds)
        self.stamps = (start, time.time())

    def build_stamps(self) -> tuple[float, float]:
        return self.stamps
