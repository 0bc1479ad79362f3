"""`global_profiler`: torch.profiler over the chosen steps of a run, in every process of it.

For each profiled step (or run of consecutive steps with `profile_continuous_steps`) every
worker process profiles itself, and so does the driver when no role lives in it; each
writes `<name>.trace.json`, `<name>.phases.txt` (the nested phases with wall, device-busy
and device-idle time: `ember/profiling.py`) and `<name>.operators.txt` into
`<save_path>/step_N` (or `steps_N-M`: the steps it holds). A run resumed inside a range
profiles the rest of it; a range past the run's last step is cut there; a step that fails
stops every profile and writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ember.config.schema.profiler import GlobalProfilerConfig
from ember.distributed.worker_group import LocalWorkerGroup
from ember.profiling import ProcessProfile

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

    def __init__(self, config: GlobalProfilerConfig, groups: list, total_steps: int):
        self.save_path = os.path.abspath(config.save_path)  # the same folder for workers whatever their directory
        traced = config.tool == "torch"  # torch_memory's snapshots: memory_snapshots.py
        ranges = profiled_ranges(config.steps, config.profile_continuous_steps) if traced else []
        beyond = [step for step in config.steps or [] if step > total_steps] if traced else []
        if beyond:
            logger.warning("global_profiler.steps %s are past the run's last step %d: not profiled", beyond, total_steps)
        self.ranges = [(first, min(last, total_steps)) for first, last in ranges if first <= total_steps]
        self.groups = groups
        self.driver = None if any(isinstance(group, LocalWorkerGroup) for group in groups) else ProcessProfile()
        self.active: tuple[int, int] | None = None  # the steps of the profile running now

    @contextlib.contextmanager
    def around(self, step: int):
        """Profiles the block if `step` is profiled: started at the first step of a range this process
        runs (a resumed run joins a range midway), written after its last."""
        if self.active is None:
            span = next(((first, last) for first, last in self.ranges if first <= step <= last), None)
            if span is not None:
                self._start()
                self.active = (step, span[1])
        try:
            yield
        except BaseException:
            if self.active is not None:
                self._cancel()
            raise
        if self.active is not None and self.active[1] == step:
            self._write()

    def _start(self) -> None:
        if self.driver is not None:
            self.driver.start()
        for group in self.groups:
            group.run_all("start_profile")

    def _cancel(self) -> None:
        """A failed step: every profile stopped, nothing written (workers that died have nothing to stop)."""
        self.active = None
        if self.driver is not None:
            self.driver.cancel()
        for group in self.groups:
            with contextlib.suppress(Exception):
                group.run_all("cancel_profile")

    def _write(self) -> None:
        (first, last), self.active = self.active, None
        folder = os.path.join(self.save_path, f"step_{first}" if first == last else f"steps_{first}-{last}")
        tables = []
        for group in self.groups:
            tables += group.run_all("stop_profile", folder)
        if self.driver is not None:
            tables.append(("driver", self.driver.stop(folder, "driver")))
        name, table = tables[0]
        logger.info("profile of %s written to %s; phases of %s:\n%s", f"step {first}" if first == last
                    else f"steps {first}-{last}", folder, name, table)
