"""A DCP checkpoint's pickles are read without running code: the allow-list holds exactly what the
installed torch writes into `.metadata`, and a planted `__reduce__` (in `.metadata`, alone or inside
valid metadata, or in a non-tensor entry) is refused by name and never runs."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from planted_pickles import pickled_globals, plant_in_entry, plant_in_metadata
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from ember.engines.dcp_folder import dcp_folder_problem
from ember.engines.safe_pickle import (
    DCP_METADATA_GLOBALS,
    RefusedPickle,
    RestrictedFileSystemReader,
    RestrictedLoadPlanner,
)


@pytest.fixture
def checkpoint(tmp_path):
    """`dcp.save` of a small model's state (bf16 and fp32 tensors) and of its AdamW state after one step."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[1](model[0](torch.randn(3, 4)).to(torch.bfloat16)).float().sum().backward()
    optimizer.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=tmp_path / "model", no_dist=True)
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=tmp_path / "optim", no_dist=True)
    return tmp_path


def test_the_allow_list_covers_what_torch_writes_and_reads_it_as_pickle_does(checkpoint):
    for folder in ("model", "optim"):
        data = (checkpoint / folder / ".metadata").read_bytes()
        assert pickled_globals(data) <= DCP_METADATA_GLOBALS
        assert ("torch", "bfloat16") in pickled_globals(data)
        assert RestrictedFileSystemReader(checkpoint / folder).read_metadata().storage_data == \
            pickle.loads(data).storage_data
        assert dcp_folder_problem(str(checkpoint / folder), read_entries=True) is None


def test_restricted_load_reads_the_optimizers_non_tensor_entries(checkpoint):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5.0)
    state = get_optimizer_state_dict(model, optimizer)
    state["state"] = {}
    dcp.load(state, storage_reader=RestrictedFileSystemReader(checkpoint / "optim"),
             planner=RestrictedLoadPlanner(allow_partial_load=True), no_dist=True)
    assert state["param_groups"][0]["lr"] == 1e-3 and state["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("inside_valid_metadata", [False, True])
def test_a_payload_in_metadata_is_refused_by_name_and_never_runs(checkpoint, tmp_path, inside_valid_metadata):
    marker = tmp_path / "ran"
    plant_in_metadata(checkpoint / "optim", marker, inside_valid_metadata)
    metadata_file = checkpoint / "optim" / ".metadata"
    problem = dcp_folder_problem(str(checkpoint / "optim"))
    assert problem.startswith(f"{metadata_file} is refused: its pickle references posix.system, which is not on")
    with pytest.raises(RefusedPickle, match="posix.system") as refused:
        RestrictedFileSystemReader(checkpoint / "optim").read_metadata()
    assert refused.value.source == str(metadata_file)
    assert not marker.exists()


def test_a_payload_in_a_non_tensor_entry_is_refused_by_the_check_and_by_the_load(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    entry, shard = plant_in_entry(checkpoint / "optim", marker)
    assert dcp_folder_problem(str(checkpoint / "optim")) is None  # the load refuses it (below)
    problem = dcp_folder_problem(str(checkpoint / "optim"), read_entries=True)  # for megatron-core's load
    assert problem.startswith(f"{checkpoint / 'optim' / shard} (entry {entry}) is refused: its pickle "
                              "references posix.system")
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to(torch.bfloat16))
    state = get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(BaseException, match="posix.system"):  # DCP wraps each rank's error (a BaseException)
        dcp.load(state, storage_reader=RestrictedFileSystemReader(checkpoint / "optim"),
                 planner=RestrictedLoadPlanner(allow_partial_load=True), no_dist=True)
    assert not marker.exists()
