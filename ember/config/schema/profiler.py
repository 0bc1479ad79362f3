"""`global_profiler`: which steps of `ember train` are profiled, with verl's keys."""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_

ProfilerTool = Literal["torch", "nsys", "npu", "torch_memory"]


@dataclass
class GlobalProfilerConfig:
    """torch.profiler over chosen training steps: a trace per process and a phase table."""

    tool: ProfilerTool | None = field_(
        None, "torch: torch.profiler traces (chrome://tracing or ui.perfetto.dev) and a table of each phase's wall "
              "and device-busy time; null = no profiling")
    steps: list[int] | None = field_(None, "training steps to profile, e.g. [2, 5]; null = none")
    profile_continuous_steps: bool = field_(
        False, "consecutive steps of `steps` go into one trace instead of one trace each")
    save_path: str = field_("outputs/profile", "folder of the traces: step_N/ (or steps_N-M/) holds each process's "
                                               "trace, phases.txt and operators.txt")
