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

    def __init__(self, offset: int):
        init_distributed()
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
