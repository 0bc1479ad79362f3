"""global_profiler.tool=torch_memory on a GPU: the snapshot a process writes holds the blocks it allocated
after recording started, with the stacks that allocated them."""

import pickle

import pytest
import torch

from ember.config.schema.profiler import TorchMemoryToolConfig
from ember.trainer.memory_snapshots import dump_memory_snapshot, start_memory_history

pytestmark = pytest.mark.gpu


def test_a_snapshot_holds_the_allocations_recorded(tmp_path):
    assert start_memory_history(TorchMemoryToolConfig(trace_alloc_max_entries=1000), "actor_rank0")
    block = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # 3 MiB: its own segment
    try:
        path = dump_memory_snapshot(str(tmp_path / "step_1"), "actor_rank0")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    blocks = [block for segment in snapshot["segments"] for block in segment["blocks"]
              if block["state"] == "active_allocated"]
    assert any(entry["size"] >= block.numel() and entry.get("frames") for entry in blocks)
    assert any(event["action"] == "alloc" for trace in snapshot["device_traces"] for event in trace)
