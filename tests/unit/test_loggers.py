"""MetricLogger on a run folder an earlier run wrote to: a resume keeps that run's records up to
the resumed step and drops the later ones, in metrics.jsonl and for TensorBoard's readers."""

from __future__ import annotations

import json
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ember.trainer.loggers import MetricLogger, read_jsonl_metrics


def log_steps(run_dir, resumed_step, steps, value):
    metric_logger = MetricLogger(str(run_dir), ["tensorboard"], total_steps=5)
    metric_logger.start(resumed_step)
    for step in steps:
        metric_logger.log(step, {"loss": value + step})
    metric_logger.close()


def tensorboard_scalars(run_dir, tag):
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_a_resume_drops_what_the_earlier_run_logged_after_its_checkpoint(tmp_path):
    log_steps(tmp_path, None, [1, 2, 3, 4], value=0.0)  # killed after step 4, checkpoint at 2
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "lo')  # the line the kill cut short
    time.sleep(1.1)  # TensorBoard orders event files by the second they were created in
    log_steps(tmp_path, 2, [3, 4, 5], value=10.0)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 13.0},
                       {"step": 4, "loss": 14.0}, {"step": 5, "loss": 15.0}]
    assert tensorboard_scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def test_a_fresh_start_drops_everything_an_earlier_run_logged(tmp_path):
    log_steps(tmp_path, None, [1, 2], value=0.0)
    time.sleep(1.1)
    log_steps(tmp_path, None, [1], value=10.0)
    assert read_jsonl_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 11.0}]
    assert tensorboard_scalars(tmp_path, "loss") == [(1, 11.0)]


def test_lines_that_are_not_records_neither_crash_a_resume_nor_a_reader(tmp_path):
    log_steps(tmp_path, None, [1, 2], value=0.0)
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('null\n[3]\n{"loss": 1.0}\n{"step": "3"}\n')
    assert read_jsonl_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    log_steps(tmp_path, 2, [3], value=10.0)
    assert read_jsonl_metrics(str(tmp_path / "metrics.jsonl"))[-1] == {"step": 3, "loss": 13.0}


def test_logging_before_start_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="before start"):
        MetricLogger(str(tmp_path), ["console"], total_steps=1).log(1, {"loss": 1.0})


def test_tensorboard_dir_in_the_environment_is_where_events_go(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    log_steps(tmp_path / "run", None, [1, 2], value=0.0)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("loss")] == [(1, 1.0), (2, 2.0)]
    assert not (tmp_path / "run" / "tensorboard").exists()
