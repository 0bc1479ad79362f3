"""`global_profiler`: which steps of `ember train` are profiled, with verl's keys."""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_, section

ProfilerTool = Literal["torch", "nsys", "npu", "torch_memory"]


@dataclass
class TorchMemoryToolConfig:
    """`tool=torch_memory`: how each process records its CUDA allocations (torch.cuda.memory._record_memory_history)."""

    trace_alloc_max_entries: int = field_(100_000, "most allocation events kept per process (older ones are dropped)")
    context: Literal["state", "alloc", "all"] = field_(
        "all", "events recorded: state = the live blocks only, alloc = allocations too, all = frees too")
    stacks: Literal["python", "all"] = field_("all", "stack traces recorded: python, or all = python and C++")


@dataclass
class GlobalToolConfig:
    """Options of each profiler tool (verl's `global_tool_config`; ember reads torch_memory's)."""

    torch_memory: TorchMemoryToolConfig = section(TorchMemoryToolConfig, "CUDA memory snapshots")


@dataclass
class GlobalProfilerConfig:
    """torch.profiler over chosen training steps (a trace per process and a phase table), or CUDA memory
    snapshots after them."""

    tool: ProfilerTool | None = field_(
        None, "torch: torch.profiler traces (chrome://tracing or ui.perfetto.dev) and a table of each phase's wall "
              "and device-busy time; torch_memory: a CUDA memory snapshot of each process after the steps "
              "(pytorch.org/memory_viz); null = no profiling")
    steps: list[int] | None = field_(
        None, "training steps to profile, e.g. [2, 5]; null = none (torch), every step (torch_memory, as verl)")
    profile_continuous_steps: bool = field_(
        False, "consecutive steps of `steps` go into one trace instead of one trace each")
    save_path: str = field_("outputs/profile", "folder of the traces: step_N/ (or steps_N-M/) holds each process's "
                                               "trace, phases.txt and operators.txt (torch_memory: its .pickle)")
    global_tool_config: GlobalToolConfig = section(GlobalToolConfig, "options of each tool")
