"""`global_profiler.tool=torch_memory`: a CUDA memory snapshot of every process of a run after chosen steps
(verl's torch_memory tool).

Each worker process records its CUDA allocator's events from the moment its roles are built
(`torch.cuda.memory._record_memory_history` with `global_tool_config.torch_memory`'s options), and after each
snapshot step writes `<save_path>/step_N/<process>.memory.pickle`, which https://pytorch.org/memory_viz opens
(live blocks with the stacks that allocated them, and the last `trace_alloc_max_entries` events). The steps are
`global_profiler.steps`, or every step when it is null, as verl's trainer dumps after every step. A process
without CUDA has nothing to record: it says so once when it starts and writes nothing.
"""

from __future__ import annotations

import logging
import os

import torch

from ember.config.schema.profiler import GlobalProfilerConfig, TorchMemoryToolConfig

logger = logging.getLogger("ember.trainer")


def start_memory_history(options: TorchMemoryToolConfig, process_name: str) -> bool:
    """Record this process's CUDA allocations from now on; False (and a warning) where there is no CUDA device."""
    if not torch.cuda.is_available():
        logger.warning("global_profiler.tool=torch_memory: %s has no CUDA device, so no memory snapshots are written",
                       process_name)
        return False
    torch.cuda.memory._record_memory_history(context=options.context, stacks=options.stacks,
                                             max_entries=options.trace_alloc_max_entries)
    return True


def dump_memory_snapshot(folder: str, process_name: str) -> str:
    """This process's snapshot as `<folder>/<process_name>.memory.pickle`; its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{process_name}.memory.pickle")
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    return path


class MemorySnapshots:
    """Asks every worker process for its snapshot after the steps `global_profiler` names (torch_memory only)."""

    def __init__(self, config: GlobalProfilerConfig, groups: list):
        self.enabled = config.tool == "torch_memory"
        self.steps = None if config.steps is None else set(config.steps)
        self.save_path = os.path.abspath(config.save_path)  # the same folder for workers whatever their directory
        self.groups = groups

    def after(self, step: int) -> list[str]:
        """The snapshots written after `step` (none when it is not a snapshot step or no process has CUDA)."""
        if not self.enabled or (self.steps is not None and step not in self.steps):
            return []
        folder = os.path.join(self.save_path, f"step_{step}")
        paths = [path for group in self.groups for path in group.run_all("dump_memory_snapshot", folder) if path]
        if paths:
            logger.info("memory snapshots of step %d written to %s", step, folder)
        return paths
