"""The phase table of a profile (phases nested by time, device time counted once inside each), and which
steps `global_profiler` profiles."""

import logging

import pytest

from ember.profiling import PHASE_PREFIX, format_phase_rows, phase, phase_rows
from ember.trainer.step_profiler import profiled_ranges


def annotation(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": PHASE_PREFIX + name, "ts": ts, "dur": dur}


def kernel(ts: float, dur: float, category: str = "kernel") -> dict:
    return {"ph": "X", "cat": category, "name": "k", "ts": ts, "dur": dur}


def test_phases_nest_by_time_and_count_overlapping_device_work_once():
    trace = {"traceEvents": [
        annotation("step", 0, 100),
        annotation("gen", 0, 40),
        annotation("engine/decode", 10, 10), annotation("engine/decode", 25, 10),
        annotation("update_actor", 50, 50),
        kernel(12, 6), kernel(14, 6),           # two streams overlapping: busy 12..20 = 8
        kernel(30, 20, "gpu_memcpy"),           # 30..50: 5 in the second decode, 10 more in gen, 0 in update
        kernel(60, 10, "gpu_memset"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host work is not device time
        {"ph": "i", "cat": "user_annotation", "name": PHASE_PREFIX + "ignored", "ts": 5},
    ]}
    rows = {row.path: row for row in phase_rows(trace)}
    assert list(rows) == [("step",), ("step", "gen"), ("step", "gen", "engine/decode"), ("step", "update_actor")]
    decode = rows[("step", "gen", "engine/decode")]
    assert (decode.calls, decode.wall_us, decode.busy_us) == (2, 20, 8 + 5)
    assert rows[("step", "gen")].busy_us == 8 + 10
    assert rows[("step", "update_actor")].busy_us == 10 and rows[("step", "update_actor")].idle_us == 40
    assert rows[("step",)].busy_us == 8 + 20 + 10 and rows[("step",)].idle_us == 100 - 38
    table = format_phase_rows(list(rows.values()), has_device=True)
    assert "\n    engine/decode " in table and "\n  update_actor " in table  # indented under their parents


def test_without_device_events_the_table_says_so():
    table = format_phase_rows(phase_rows({"traceEvents": [annotation("step", 0, 2000)]}), has_device=False)
    assert "no device activity" in table and "2.0" in table


def test_profiled_ranges_one_per_step_or_joined_when_continuous():
    assert profiled_ranges([5, 2, 3], continuous=False) == [(2, 2), (3, 3), (5, 5)]
    assert profiled_ranges([5, 2, 3, 3], continuous=True) == [(2, 3), (5, 5)]
    assert profiled_ranges(None, continuous=True) == []


def profiler(tmp_path, steps, total_steps=10, continuous=True):
    from ember.config.schema.profiler import GlobalProfilerConfig
    from ember.trainer.step_profiler import StepProfiler

    config = GlobalProfilerConfig(tool="torch", steps=steps, profile_continuous_steps=continuous,
                                  save_path=str(tmp_path / "profile"))
    return StepProfiler(config, groups=[], total_steps=total_steps)  # no worker groups: the driver profiles itself


def run_steps(step_profiler, steps):
    for step in steps:
        with step_profiler.around(step):
            with phase("step"):
                pass


def test_a_run_resumed_inside_a_range_profiles_the_rest_of_it(tmp_path):
    step_profiler = profiler(tmp_path, [3, 4, 5])
    run_steps(step_profiler, [4, 5, 6])  # resumed after step 3
    assert [path.name for path in (tmp_path / "profile").iterdir()] == ["steps_4-5"]
    assert (tmp_path / "profile" / "steps_4-5" / "driver.phases.txt").read_text().count("\nstep ") == 1


def test_a_failed_step_stops_the_profile_and_writes_nothing(tmp_path):
    step_profiler = profiler(tmp_path, [2], continuous=False)
    with pytest.raises(RuntimeError, match="the step failed"):
        with step_profiler.around(2):
            raise RuntimeError("the step failed")
    assert not (tmp_path / "profile").exists() and step_profiler.active is None
    run_steps(step_profiler, [2])  # the process can be profiled again
    assert (tmp_path / "profile" / "step_2" / "driver.trace.json").is_file()


def test_steps_past_the_run_are_cut_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ember.trainer"):
        step_profiler = profiler(tmp_path, [4, 5, 6, 9], total_steps=5)
    assert step_profiler.ranges == [(4, 5)] and "[6, 9] are past the run's last step 5" in caplog.text
