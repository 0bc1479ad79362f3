"""Profiling a process with torch.profiler, and where its time goes phase by phase.

Code marks its phases with `phase("gen")`, `phase("engine/decode")`, ... (a
`torch.profiler.record_function` named `ember/<name>`: a few microseconds when no profiler
runs). `ProcessProfile` profiles this process between `start` and `stop`, writes its trace
(chrome://tracing, ui.perfetto.dev), the top operators, and a table that gives for every
phase, nested as they ran, its calls, wall time, the time the device was busy inside it
(the union of its kernels, copies and memsets) and the rest: the device idle time, which
is what host work, launches and syncs cost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

PHASE_PREFIX = "ember/"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def phase(name: str) -> torch.profiler.record_function:
    """Marks a block as phase `name` in a profile (`with phase("engine/decode"): ...`)."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


# --- the table of phases --------------------------------------------------------------------------


@dataclass
class PhaseRow:
    """One phase at one place in the nesting, summed over its calls (µs)."""

    path: tuple[str, ...]
    calls: int = 0
    wall_us: float = 0.0
    busy_us: float = 0.0

    @property
    def idle_us(self) -> float:
        return max(self.wall_us - self.busy_us, 0.0)


@dataclass
class _Span:
    name: str
    start: float
    end: float
    children: list[_Span] = field(default_factory=list)


def phase_rows(trace: dict) -> list[PhaseRow]:
    """The phases of a chrome trace (as torch.profiler exports it), nested by time, with the device
    time inside each; rows in the order phases first ran, parents before their children."""
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X" and "dur" in event]
    spans = sorted((_Span(event["name"][len(PHASE_PREFIX):], float(event["ts"]), float(event["ts"]) + float(event["dur"]))
                    for event in events
                    if event.get("cat") == "user_annotation" and event.get("name", "").startswith(PHASE_PREFIX)),
                   key=lambda span: (span.start, -span.end))
    device = _merged(sorted((float(event["ts"]), float(event["ts"]) + float(event["dur"]))
                            for event in events if event.get("cat") in DEVICE_CATEGORIES))
    roots: list[_Span] = []
    open_spans: list[_Span] = []
    for span in spans:
        while open_spans and open_spans[-1].end <= span.start:
            open_spans.pop()
        (open_spans[-1].children if open_spans else roots).append(span)
        open_spans.append(span)
    rows: dict[tuple[str, ...], PhaseRow] = {}

    def add(span: _Span, parent: tuple[str, ...]) -> None:
        path = (*parent, span.name)
        row = rows.setdefault(path, PhaseRow(path))
        row.calls += 1
        row.wall_us += span.end - span.start
        row.busy_us += _overlap(device, span.start, span.end)
        for child in span.children:
            add(child, path)

    for root in roots:
        add(root, ())
    return list(rows.values())


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals with overlaps joined (kernels on several streams count once)."""
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals if a < end and b > start)


def format_phase_rows(rows: list[PhaseRow], has_device: bool) -> str:
    """The phase table as text, children indented under their parents."""
    header = f"{'phase':<44} {'calls':>6} {'wall ms':>10} {'device busy ms':>15} {'device idle ms':>15}"
    lines = [header, "-" * len(header)]
    for row in rows:
        name = "  " * (len(row.path) - 1) + row.path[-1]
        busy, idle = (f"{row.busy_us / 1e3:15.1f}", f"{row.idle_us / 1e3:15.1f}") if has_device else (f"{'-':>15}",) * 2
        lines.append(f"{name:<44} {row.calls:>6} {row.wall_us / 1e3:10.1f} {busy} {idle}")
    if not has_device:
        lines.append("(no device activity in this trace: wall time only)")
    return "\n".join(lines) + "\n"


# --- profiling this process -----------------------------------------------------------------------


class ProcessProfile:
    """torch.profiler over this process from `start()` to `stop(folder, name)`; one per process at a
    time (torch.profiler cannot nest): a rank worker's, or the driver's when no role lives in it."""

    def __init__(self):
        self.profiler: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self.profiler is not None

    def start(self) -> None:
        if self.profiler is not None:
            raise RuntimeError("this process is already being profiled")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def cancel(self) -> None:
        """Stop without writing anything (a failed step); nothing to do if not running."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()

    def stop(self, folder: str, name: str) -> str:
        """Stop, and write `<name>.trace.json`, `<name>.phases.txt` and `<name>.operators.txt` into
        `folder`; returns the phase table."""
        if self.profiler is None:
            raise RuntimeError("stop without start: this process is not being profiled")
        profiler, self.profiler = self.profiler, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler.stop()
        os.makedirs(folder, exist_ok=True)
        trace_path = os.path.join(folder, f"{name}.trace.json")
        profiler.export_chrome_trace(trace_path)
        with open(trace_path, encoding="utf-8") as handle:
            trace = json.load(handle)
        has_device = any(event.get("cat") in DEVICE_CATEGORIES for event in trace.get("traceEvents", []))
        table = format_phase_rows(phase_rows(trace), has_device)
        with open(os.path.join(folder, f"{name}.phases.txt"), "w", encoding="utf-8") as handle:
            handle.write(table)
        averages = profiler.key_averages()
        with open(os.path.join(folder, f"{name}.operators.txt"), "w", encoding="utf-8") as handle:
            if has_device:
                handle.write(averages.table(sort_by="device_time_total", row_limit=40) + "\n")
            handle.write(averages.table(sort_by="cpu_time_total", row_limit=40) + "\n")
        return table
