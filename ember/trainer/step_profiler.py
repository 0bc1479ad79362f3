"""`global_profiler`: torch.profiler over the chosen steps of a run, in every process of it.

For each profiled step (or run of consecutive steps with `profile_continuous_steps`) every
worker process profiles itself, and so does the driver when no role lives in it; each
writes `<name>.trace.json`, `<name>.phases.txt` (the nested phases with wall, device-busy
and device-idle time: `ember/profiling.py`) and `<name>.operators.txt` into
`<save_path>/step_N` (or `steps_N-M`). A step that fails leaves its profile unwritten.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ember.config.schema.profiler import GlobalProfilerConfig
from ember.distributed.worker_group import LocalWorkerGroup
from ember.profiling import PROCESS_PROFILE

logger = logging.getLogger("ember.trainer")


def profiled_ranges(steps: list[int] | None, continuous: bool) -> list[tuple[int, int]]:
    """(first, last) step of each profile: one per step, or one per run of consecutive steps."""
    ranges: list[tuple[int, int]] = []
    for step in sorted(set(steps or [])):
        if continuous and ranges and ranges[-1][1] == step - 1:
            ranges[-1] = (ranges[-1][0], step)
        else:
            ranges.append((step, step))
    return ranges


class StepProfiler:
    """Starts and stops the profiles of a run's processes around the steps `global_profiler` names."""

    def __init__(self, config: GlobalProfilerConfig, groups: list):
        self.save_path = config.save_path
        self.ranges = profiled_ranges(config.steps, config.profile_continuous_steps) if config.tool else []
        self.groups = groups
        self.profiles_driver = not any(isinstance(group, LocalWorkerGroup) for group in groups)

    @contextlib.contextmanager
    def around(self, step: int):
        """Profiles the block if `step` is profiled (started at a range's first step, written at its last)."""
        starts = any(first == step for first, _ in self.ranges)
        span = next(((first, last) for first, last in self.ranges if last == step), None)
        if starts:
            if self.profiles_driver:
                PROCESS_PROFILE.start()
            for group in self.groups:
                group.run_all("start_profile")
        yield
        if span is not None:
            self.write(span)

    def write(self, span: tuple[int, int]) -> None:
        first, last = span
        folder = os.path.join(self.save_path, f"step_{first}" if first == last else f"steps_{first}-{last}")
        tables = []
        for group in self.groups:
            tables += group.run_all("stop_profile", folder)
        if self.profiles_driver:
            tables.append(("driver", PROCESS_PROFILE.stop(folder, "driver")))
        name, table = tables[0]
        logger.info("profile of %s written to %s; phases of %s:\n%s", f"step {first}" if first == last
                    else f"steps {first}-{last}", folder, name, table)
