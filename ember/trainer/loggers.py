"""Metric sinks for a run: console (one line per step with elapsed time and ETA),
TensorBoard (under `$TENSORBOARD_DIR` when set), and a jsonl file that is always written; the experiment trackers wandb and
MLflow live in experiment_trackers.py.

`MetricLogger.log(step, metrics)` fans one dict of floats out to every sink. The jsonl file
is the run's record: plots and tests read it back. `MetricLogger.start(resumed_step)` opens
the sinks once the run knows where it starts, and drops what an earlier run in the folder
logged after that point (metrics.jsonl is rewritten, TensorBoard gets `purge_step`), so a
resumed run appends to the record of its checkpoint and each step is logged once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable

from ember.trainer.experiment_trackers import TRACKER_SINKS, TrackedRun

CONSOLE_KEYS = (
    "critic/score/mean",
    "val-core/mean/acc",
    "actor/pg_loss",
    "actor/entropy",
    "critic/vf_loss",
    "response_length/mean",
    "timing_s/step",
    "train/loss",
    "val/loss",
)


def format_duration(seconds: float) -> str:
    """`3725.0` -> `1:02:05`; short and readable for the console line."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ConsoleSink:
    """Prints a compact line per step: step/total, elapsed, ETA and the headline metrics."""

    def __init__(self, total_steps: int, stream=None):
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.start_time = time.monotonic()
        self.first_step: int | None = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step = step - 1
        elapsed = time.monotonic() - self.start_time
        done = step - self.first_step
        remaining = max(self.total_steps - step, 0)
        eta = elapsed / done * remaining if done > 0 else float("nan")
        shown = [f"{key}={metrics[key]:.4g}" for key in CONSOLE_KEYS if key in metrics]
        shown += [f"{key}={value:.4g}" for key, value in metrics.items()
                  if key.startswith("val-core/") and key != "val-core/mean/acc"]
        line = f"step {step}/{self.total_steps} | elapsed {format_duration(elapsed)} | eta {format_duration(eta)} | "
        print(line + " ".join(shown), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends `{"step": N, **metrics}` lines to `metrics.jsonl` in the run directory, after
    dropping the lines of steps from `first_step` on that an earlier run left there."""

    def __init__(self, path: str, first_step: int):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        if os.path.exists(path):
            _drop_records_from(path, first_step)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars to TensorBoard event files under `log_dir`; readers discard the events of earlier
    files from `first_step` on (`purge_step`)."""

    def __init__(self, log_dir: str, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=first_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_dir(run_dir: str) -> str:
    """Where TensorBoard events go: `$TENSORBOARD_DIR` when set (as verl and siiRL scripts export it
    before running `tensorboard --logdir` on it), else `run_dir/tensorboard`."""
    return os.environ.get("TENSORBOARD_DIR") or os.path.join(run_dir, "tensorboard")


SUPPORTED_LOGGERS = ("console", "tensorboard", "jsonl", *TRACKER_SINKS)


class MetricLogger:
    """Writes each step's metrics to the sinks named in `trainer.logger` plus jsonl."""

    def __init__(self, run_dir: str, loggers: Iterable[str], total_steps: int, enabled: bool = True,
                 tracked_run: TrackedRun | None = None):
        """`tracked_run` names the run for the experiment trackers (wandb, mlflow) and is
        required when `loggers` names one."""
        self.run_dir = run_dir
        self.tracked_run = tracked_run
        self.names = set(loggers)
        self.total_steps = total_steps
        self.enabled = enabled  # non-zero ranks log nothing
        self.sinks = None
        unknown = self.names - set(SUPPORTED_LOGGERS)
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {sorted(unknown)}; supported: {list(SUPPORTED_LOGGERS)}")
        if tracked_run is None and self.names & set(TRACKER_SINKS):
            raise ValueError(f"trainer.logger names {sorted(self.names & set(TRACKER_SINKS))}: pass tracked_run "
                             "(the run's names, config)")

    def start(self, resumed_step: int | None) -> None:
        """Opens the sinks for a run resumed at `resumed_step` (None: a fresh start). What an earlier
        run logged after that step, or anything at all before a fresh start, is dropped: the run
        logs those steps again."""
        first_step = 0 if resumed_step is None else resumed_step + 1
        self.sinks = []
        if not self.enabled:
            return
        if "console" in self.names:
            self.sinks.append(ConsoleSink(self.total_steps))
        if "tensorboard" in self.names:
            self.sinks.append(TensorBoardSink(tensorboard_dir(self.run_dir), first_step))
        self.sinks.append(JsonlSink(os.path.join(self.run_dir, "metrics.jsonl"), first_step))
        for name, sink in TRACKER_SINKS.items():
            if name in self.names:
                self.sinks.append(sink(self.tracked_run))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.sinks is None:
            raise RuntimeError("MetricLogger.log before start(): the run must say where it starts first")
        clean = {key: float(value) for key, value in metrics.items()}
        for sink in self.sinks:
            sink.write(step, clean)

    def close(self) -> None:
        for sink in self.sinks or []:
            sink.close()


def _drop_records_from(path: str, first_step: int) -> None:
    """Rewrites the jsonl file at `path` without the records of `first_step` and later, and without
    a last line cut short by a killed run; replaced in one rename, so a crash keeps the old file."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    kept = []
    for line in lines:
        record = _step_record(line)
        if record is not None and record["step"] < first_step:
            kept.append(line + "\n")
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.writelines(kept)
    os.replace(temporary, path)


def read_jsonl_metrics(path: str) -> list[dict[str, float]]:
    """The records a run wrote, one dict per step. Records of one step merge (training and
    validation metrics are logged separately)."""
    by_step: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = _step_record(line)
            if record is not None:
                by_step.setdefault(record["step"], {}).update(record)
    return [by_step[step] for step in sorted(by_step)]


def _step_record(line: str) -> dict | None:
    """The record of one line of metrics.jsonl; None for a line that is none (empty, the unfinished line of a
    killed run, or anything else that is not an object with an integer step, e.g. a `null` an editor left)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None
