"""Checkpoint folders of a run: listed and pruned by step number (global_step_10 after global_step_9), and
pruning deletes only the checkpoints of the run itself, never another run's left in its folder."""

from __future__ import annotations

import os

from ember.trainer.checkpoint import CheckpointManager, list_checkpoints


def write_marker(directory: str) -> None:
    with open(os.path.join(directory, "weights"), "w") as handle:
        handle.write("x")


def steps(root) -> list[int]:
    return [step for step, _ in list_checkpoints(str(root))]


def test_checkpoints_are_listed_and_pruned_by_step_number(tmp_path):
    for step in (12, 2, 10, 9, 1, 11):
        (tmp_path / f"global_step_{step}").mkdir()
    (tmp_path / ".global_step_13.tmp").mkdir()  # unfinished: not a checkpoint
    (tmp_path / "global_step_14").write_text("a file, not a folder")
    assert steps(tmp_path) == [1, 2, 9, 10, 11, 12]

    run_dir = tmp_path / "run"
    manager = CheckpointManager(str(run_dir), keep=3)
    for step in range(1, 13):
        manager.save(step, write_marker)
    assert steps(run_dir) == [10, 11, 12]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "12"


def test_pruning_spares_checkpoints_the_run_did_not_write(tmp_path):
    for step in (1, 2, 7, 8):
        (tmp_path / f"global_step_{step}").mkdir()
    fresh = CheckpointManager(str(tmp_path), keep=1)  # a run that resumed nothing: only what it writes is its own
    fresh.save(5, write_marker)
    assert steps(tmp_path) == [1, 2, 5, 7, 8]  # not pruned as "older" than another run's step 8
    fresh.save(6, write_marker)
    assert steps(tmp_path) == [1, 2, 6, 7, 8]

    resumed = CheckpointManager(str(tmp_path), keep=2)
    resumed.resumed_at(2)  # steps 1-2 are this run's past; 6-8 are not (later lines of the folder, not resumed)
    resumed.save(3, write_marker)
    assert steps(tmp_path) == [2, 3, 6, 7, 8]
    resumed.save(4, write_marker)
    assert steps(tmp_path) == [3, 4, 6, 7, 8]


def test_a_full_disk_while_saving_is_a_clean_stop_that_keeps_the_earlier_checkpoints(tmp_path):
    import errno

    import pytest

    from ember.trainer.checkpoint import CheckpointError

    manager = CheckpointManager(str(tmp_path), keep=None)
    manager.save(1, write_marker)

    def fill_the_disk(directory):
        write_marker(directory)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match=r"no space left on the device of .* while saving global_step_2 .*"
                                              r"newest: global_step_1\); run again to resume"):
        manager.save(2, fill_the_disk)
    assert steps(tmp_path) == [1] and not (tmp_path / ".global_step_2.tmp").exists()
    assert (tmp_path / "global_step_1" / "weights").read_text() == "x"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"

    def worker_failed(directory):  # a Ray worker's disk error reaches the driver as text
        raise RuntimeError("rank 1: OSError: [Errno 28] No space left on device: 'optim.pt'")

    with pytest.raises(CheckpointError, match="no space left"):
        manager.save(3, worker_failed)

    def other_failure(directory):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):  # anything else is not a full disk
        manager.save(4, other_failure)


def test_each_checkpoint_is_copied_to_default_hdfs_dir_and_the_copies_are_kept(tmp_path):
    """trainer.default_hdfs_dir on a local or mounted folder (the NLA fork's base file sets one): every published
    checkpoint is also copied there, whole; keep-N prunes the run folder only."""
    copies = tmp_path / "copies"
    manager = CheckpointManager(str(tmp_path / "run"), keep=1, copy_to=str(copies))
    for step in (1, 2):
        manager.save(step, write_marker)
    assert steps(tmp_path / "run") == [2] and steps(copies) == [1, 2]
    assert (copies / "global_step_2" / "weights").read_text() == "x"
    assert not list(copies.glob(".*.tmp"))


class EngineThatFailsToLoad:
    """An engine (or a role over Ray workers) whose load raises `error`."""

    def __init__(self, error: BaseException):
        self.error = error

    def load(self, folder: str) -> None:
        raise self.error


def test_a_worker_that_died_or_failed_otherwise_while_loading_is_not_taken_for_damaged_bytes(tmp_path):
    import pickle

    import pytest
    import torch

    from ember.distributed.worker_group import WorkerError
    from ember.trainer.checkpoint import CheckpointProblem
    from ember.trainer.resume import load_engines

    not_damage = [WorkerError("actor rank 1: its worker process died during load (ActorDiedError)"),
                  WorkerError("actor rank 0 failed in load: CUDA out of memory",
                              cause=torch.OutOfMemoryError("CUDA out of memory")),
                  WorkerError("actor rank 0 failed in load: KeyError", cause=KeyError("a bug, not the bytes"))]
    for error in not_damage:  # auto would step back past a sound checkpoint (and set it aside)
        with pytest.raises(WorkerError):
            load_engines(str(tmp_path), [("actor", EngineThatFailsToLoad(error))])
    damaged = WorkerError("actor rank 0 failed in load", cause=pickle.UnpicklingError("invalid load key, 'x'"))
    with pytest.raises(CheckpointProblem, match=r"bytes in it are damaged \(UnpicklingError: invalid load key"):
        load_engines(str(tmp_path), [("actor", EngineThatFailsToLoad(damaged))])
    with pytest.raises(CheckpointProblem, match="damaged"):  # in this process: the error itself
        load_engines(str(tmp_path), [("actor", EngineThatFailsToLoad(EOFError("Ran out of input")))])
