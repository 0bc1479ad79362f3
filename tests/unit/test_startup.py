"""The start-up breakdown: how long the process ran before the set-up, and each phase once."""

import logging
import time

import pytest

from ember.trainer.startup import StartUp, seconds_since_process_start


def test_the_process_age_is_read_from_the_system():
    age = seconds_since_process_start()
    if age is None:
        pytest.skip("this system does not say when a process started")
    assert 0 < age < 24 * 3600
    time.sleep(0.05)
    assert seconds_since_process_start() >= age + 0.04


def test_phases_add_up_and_are_reported_once(caplog):
    startup = StartUp()
    for _ in range(2):
        with startup.phase("data"):
            time.sleep(0.01)
    with startup.phase("roles"):
        time.sleep(0.02)
    with caplog.at_level(logging.INFO, logger="ember.trainer"):
        metrics = startup.metrics()
    assert metrics["timing_s/startup/data"] >= 0.02 and metrics["timing_s/startup/roles"] >= 0.02
    assert metrics["timing_s/startup/total"] == pytest.approx(sum(v for k, v in metrics.items() if not k.endswith("total")))
    assert "start-up before the first step" in caplog.text and "roles" in caplog.text
    assert startup.metrics() == {}  # only with the first step
