"""global_profiler.tool=torch_memory (verl's CUDA memory snapshots): which steps are snapshotted, what the
config accepts, and that a process without CUDA says it writes nothing."""

import logging

import pytest

from ember.config import ConfigError, load_config
from ember.config.schema.profiler import GlobalProfilerConfig
from ember.trainer.memory_snapshots import MemorySnapshots, start_memory_history


class RecordingGroup:
    """A worker group whose one process answers each snapshot request with a path."""

    def __init__(self):
        self.folders = []

    def run_all(self, method, folder):
        assert method == "dump_memory_snapshot"
        self.folders.append(folder)
        return [f"{folder}/actor_rank0.memory.pickle"]


def snapshot_steps(tmp_path, **config):
    group = RecordingGroup()
    snapshots = MemorySnapshots(GlobalProfilerConfig(save_path=str(tmp_path), **config), [group])
    for step in (1, 2, 3):
        snapshots.after(step)
    return [folder.removeprefix(f"{tmp_path}/") for folder in group.folders]


def test_snapshots_follow_steps_or_every_step_as_verl_and_only_with_torch_memory(tmp_path):
    assert snapshot_steps(tmp_path, tool="torch_memory") == ["step_1", "step_2", "step_3"]
    assert snapshot_steps(tmp_path, tool="torch_memory", steps=[2]) == ["step_2"]
    assert snapshot_steps(tmp_path, tool="torch", steps=[2]) == []  # torch.profiler's traces: step_profiler.py


def test_the_config_takes_verls_torch_memory_keys_and_checks_steps():
    profiler = load_config(["global_profiler.tool=torch_memory",
                            "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=5000",
                            "global_profiler.global_tool_config.torch_memory.stack_depth=32"]).global_profiler
    assert profiler.steps is None and profiler.global_tool_config.torch_memory.trace_alloc_max_entries == 5000
    with pytest.raises(ConfigError, match=r"global_profiler.steps=\[0\]: steps count from 1"):
        load_config(["global_profiler.tool=torch_memory", "global_profiler.steps=[0]"])
    with pytest.raises(ConfigError, match=r"global_profiler.tool=nsys is not implemented yet; use torch .* or "
                                          r"torch_memory"):
        load_config(["global_profiler.tool=nsys", "global_profiler.steps=[1]"])


def test_a_process_without_cuda_records_nothing_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert start_memory_history(GlobalProfilerConfig().global_tool_config.torch_memory, "actor_rank0") is False
    assert "actor_rank0 has no CUDA device, so no memory snapshots are written" in caplog.text
