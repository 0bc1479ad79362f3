"""One process of an RL run: the roles placed on its GPU, built from the configuration.

A run on one device builds a single RankWorker in the driver's process (`LocalWorkerGroup`);
a run on many GPUs has each Ray worker of a resource pool build one (`RayWorkerGroup`), whose
engines are then ranks of that pool's process group. Role names: "actor", "rollout" (always
beside the actor: it syncs from the actor's engine in the same process), "reference",
"critic". The driver reaches the roles only through `call` (see `role_groups.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ember.config.schema import EmberConfig
from ember.distributed.device import init_distributed, peak_memory_bytes, rank
from ember.profiling import ProcessProfile, phase
from ember.trainer.memory_snapshots import dump_memory_snapshot, start_memory_history


class RankWorker:
    """The roles of one rank; `call(role, method, ...)` runs a role's method here."""

    def __init__(self, cfg: EmberConfig, roles: Sequence[str], total_steps: int):
        from ember.trainer.rank_setup import build_rank_roles, use_configured_device

        use_configured_device(cfg.trainer.device)
        # this rank's process group (a one-rank group in the driver's process)
        init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
        self.name = f"{'+'.join(roles)}_rank{rank()}"  # its profiles' file names
        profiler = cfg.global_profiler
        self.records_memory = (profiler.tool == "torch_memory"  # before the roles allocate, so the snapshots hold them
                               and start_memory_history(profiler.global_tool_config.torch_memory, self.name))
        self.roles = build_rank_roles(cfg, tuple(roles), total_steps)
        self.profile = ProcessProfile()

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        with phase(f"{role}.{method}"):
            return getattr(self.roles[role], method)(*args, **kwargs)

    def call_measured(self, role: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float, int]:
        """`call`, with the seconds it took on this rank and this process's peak memory after it."""
        start = time.perf_counter()
        result = self.call(role, method, *args, **kwargs)
        return result, time.perf_counter() - start, peak_memory_bytes()

    def start_profile(self) -> None:
        """Profile this process until `stop_profile` or `cancel_profile` (global_profiler)."""
        self.profile.start()

    def stop_profile(self, folder: str) -> tuple[str, str]:
        """Write this process's profile into `folder`; its name and phase table."""
        return self.name, self.profile.stop(folder, self.name)

    def cancel_profile(self) -> None:
        self.profile.cancel()

    def dump_memory_snapshot(self, folder: str) -> str | None:
        """global_profiler.tool=torch_memory: this process's CUDA memory snapshot into `folder`; its path (None
        where the process has no CUDA device)."""
        return dump_memory_snapshot(folder, self.name) if self.records_memory else None
