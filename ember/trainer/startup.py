"""Where a run's start-up goes, from the process's start to its first training step.

`StartUp` is made when the run's set-up begins; its time before that (the interpreter,
imports, config loading; for the built-in demo also its warm start) is `before_setup`,
counted from the process's start where the system says when that was (Linux's /proc).
`phase(name)` times a block of the set-up: `data`, `rewards`, `roles` (every process's
engines: models loaded, sharded, compiled; the rollout engine), then `resume` and
`validation`. With the first step this process trains, the run
logs one line and `timing_s/startup/*` metrics; the rest up to that step (the first step's
own compilation and graph capture) is the step's `timing_s/step`.
"""

from __future__ import annotations

import logging
import os

from ember.trainer.metrics import timed

logger = logging.getLogger("ember.trainer")


def seconds_since_process_start() -> float | None:
    """How long this process has run, from /proc (None where the system does not say)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
    except (OSError, ValueError, IndexError):
        return None


class StartUp:
    """Seconds of each start-up phase of a run; see the module docstring."""

    def __init__(self):
        before = seconds_since_process_start()
        self.phases: dict[str, float] = {} if before is None else {"before_setup": before}
        self.reported = False

    def phase(self, name: str):
        """Times the block as start-up phase `name` (repeated blocks add up)."""
        return timed(self.phases, name)

    def metrics(self) -> dict[str, float]:
        """`timing_s/startup/<phase>` and their total, once: empty after the first call."""
        if self.reported:
            return {}
        self.reported = True
        metrics = {f"timing_s/startup/{name}": seconds for name, seconds in self.phases.items()}
        metrics["timing_s/startup/total"] = sum(self.phases.values())
        logger.info("start-up before the first step: %.1f s (%s)", metrics["timing_s/startup/total"],
                    ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items()))
        return metrics
