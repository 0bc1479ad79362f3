"""Damaged checkpoints: each bad file is an error naming the checkpoint and the file (exit 2, no
traceback) for `ember train` and `ember sft` resumes and for `ember export`; resume_mode=auto
steps back to the newest checkpoint that loads, also when the damage shows only while loading."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from fixtures import make_tiny_model_dir

from ember.cli import main as ember_main
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_rows, sft_row_from_rl_row
from ember.trainer.checkpoint import CheckpointError
from ember.trainer.export import export_checkpoint
from ember.trainer.loggers import read_jsonl_metrics
from rl_helpers import build_trainer, close, engine_weights, hf_weights, run_overrides


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def overwrite_in_place(path: Path) -> None:
    """Same length, bytes damaged: only a load can tell."""
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256) + b"\0" * (path.stat().st_size % 256))


def shard(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


# Each damage to global_step_3, and the file an error must name.
DAMAGE = {
    "model shard cut short": (lambda step: cut_short(shard(step / "actor" / "model")), "actor/model/__0_0.distcp"),
    "optimizer metadata missing": (lambda step: (step / "actor" / "optim" / ".metadata").unlink(),
                                   "actor/optim/.metadata"),
    "model metadata cut short": (lambda step: cut_short(step / "actor" / "model" / ".metadata"), "actor/model/.metadata"),
    "engine state not JSON": (lambda step: cut_short(step / "actor" / "engine_state.json"), "actor/engine_state.json"),
    "rng state cut short": (lambda step: cut_short(step / "rng_state.pt"), "rng_state.pt"),
    "trainer state not JSON": (lambda step: cut_short(step / "trainer_state.json"), "trainer_state.json"),
    "trainer state missing": (lambda step: (step / "trainer_state.json").unlink(), "trainer_state.json"),
}


@pytest.fixture(scope="module")
def rl_run(inputs, tmp_path_factory):
    """A finished 3-step GRPO run with checkpoints at steps 2 and 3, and the policy of step 2."""
    root = tmp_path_factory.mktemp("damage")
    run_dir = root / "run"
    overrides = run_overrides(inputs, run_dir, "trainer.save_freq=2", "trainer.val_before_train=False")
    trainer = build_trainer(overrides)
    try:
        trainer.fit()
    finally:
        close(trainer)
    step_2_policy = hf_weights(export_checkpoint(str(run_dir / "global_step_2"), str(root / "step2")))
    return run_dir, step_2_policy


def damaged_copy(rl_run, tmp_path, *damages) -> tuple[Path, list[str]]:
    """A copy of the run with `damages` applied to its global_step_3 (one or two: then also to global_step_2)."""
    run_dir = tmp_path / "run"
    shutil.copytree(rl_run[0], run_dir)
    for damage, step in zip(damages, (3, 2)):
        DAMAGE[damage][0](run_dir / f"global_step_{step}")
    return run_dir, [DAMAGE[damage][1] for damage in damages]


def printed_error(capsys) -> str:
    """What the command printed from its `error: ` line on (progress bars come before it), after
    checking that it printed no traceback."""
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    return stderr[stderr.index("error: "):]


def assert_same_optimizer_state(engine, reference) -> None:
    state, expected = engine.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    assert state.keys() == expected.keys() and state
    for index, values in expected.items():
        for name, value in values.items():
            actual = state[index][name]
            if isinstance(value, DTensor):
                actual, value = actual.full_tensor(), value.full_tensor()
            assert torch.equal(actual, value), (index, name)


def run_args(inputs, run_dir, *extra):
    return run_overrides(inputs, run_dir, "trainer.save_freq=2", "trainer.val_before_train=False", *extra)


@pytest.mark.parametrize("damage", [*DAMAGE, "optimizer shard damaged in place"])
def test_auto_resume_steps_back_to_the_newest_checkpoint_that_loads(damage, rl_run, inputs, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(rl_run[0], run_dir)
    if damage in DAMAGE:
        DAMAGE[damage][0](run_dir / "global_step_3")
        bad_file = DAMAGE[damage][1]
    else:  # the model loads from step 3 first, then the optimizer fails: step 2 must replace all of it
        overwrite_in_place(shard(run_dir / "global_step_3" / "actor" / "optim"))
        bad_file = "global_step_3/actor does not load although every file is there"
    trainer = build_trainer(run_args(inputs, run_dir))
    with caplog.at_level(logging.WARNING, logger="ember.trainer"):
        trainer.resume()
    close(trainer)

    assert trainer.step == 2 and trainer.parts.train_loader.state_dict()["position"] == 2
    weights = engine_weights(trainer.parts.actor.in_process().engine)
    assert all(torch.equal(weights[name], tensor) for name, tensor in rl_run[1].items())
    assert trainer.guard.last_sound_checkpoint == str(run_dir / "global_step_2")
    if damage not in DAMAGE:  # the optimizer state too is step 2's, as a clean load of it gives
        clean = build_trainer(run_args(inputs, run_dir, "trainer.resume_mode=resume_path",
                                       f"trainer.resume_from_path={run_dir / 'global_step_2'}"))
        clean.resume()
        close(clean)
        assert_same_optimizer_state(trainer.parts.actor.in_process().engine, clean.parts.actor.in_process().engine)
    warning = next(record.message for record in caplog.records if "cannot be loaded" in record.message)
    assert warning.startswith(f"checkpoint {run_dir / 'global_step_3'} cannot be loaded: {run_dir / 'global_step_3'}/")
    assert bad_file in warning and f"resuming from {run_dir / 'global_step_2'} instead" in warning


def test_auto_resume_with_no_checkpoint_that_loads_exits_2_naming_each(rl_run, inputs, tmp_path, capsys):
    run_dir, bad_files = damaged_copy(rl_run, tmp_path, "rng state cut short", "model shard cut short")
    assert ember_main(["train", *run_args(inputs, run_dir)]) == 2
    error = printed_error(capsys)
    assert error.startswith(f"error: none of the 2 checkpoint(s) in {run_dir} can be loaded:\n"
                            f"  - {run_dir / 'global_step_3'}: {run_dir / 'global_step_3' / bad_files[0]} does not load")
    assert f"  - {run_dir / 'global_step_2'}: {run_dir / 'global_step_2' / bad_files[1]} is cut short" in error
    assert "trainer.resume_mode=disable" in error
    assert not (run_dir / "global_step_4").exists() and read_jsonl_metrics(str(run_dir / "metrics.jsonl"))


def test_resume_path_to_a_damaged_checkpoint_exits_2(rl_run, inputs, tmp_path, capsys):
    run_dir, _ = damaged_copy(rl_run, tmp_path, "optimizer metadata missing")
    checkpoint = run_dir / "global_step_3"
    assert ember_main(["train", *run_args(inputs, run_dir, "trainer.resume_mode=resume_path",
                                          f"trainer.resume_from_path={checkpoint}")]) == 2
    error = printed_error(capsys)
    assert error.startswith(f"error: checkpoint {checkpoint} cannot be loaded: {checkpoint}/actor/optim/.metadata is "
                            "missing. Point trainer.resume_from_path at another global_step_N folder")


@pytest.mark.parametrize("damage", ["model shard cut short", "model metadata cut short", "engine state not JSON"])
def test_export_of_a_damaged_checkpoint_exits_2_naming_the_file(damage, rl_run, tmp_path, capsys):
    run_dir, (bad_file,) = damaged_copy(rl_run, tmp_path, damage)
    checkpoint = run_dir / "global_step_3"
    assert ember_main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    error = printed_error(capsys)
    assert error.startswith(f"error: checkpoint {checkpoint} cannot be exported: {checkpoint / bad_file} ")
    assert "Export another global_step_N folder" in error
    assert not (tmp_path / "out").exists()


def test_export_of_a_shard_damaged_in_place_exits_2(rl_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(rl_run[0], run_dir)
    overwrite_in_place(shard(run_dir / "global_step_3" / "actor" / "model"))
    with pytest.raises(CheckpointError, match=f"{run_dir / 'global_step_3'}/actor does not load although"):
        export_checkpoint(str(run_dir / "global_step_3"), str(tmp_path / "out"))


# --- ember sft ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-damage")
    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 8, seed=0)]
    return make_tiny_model_dir(root), write_parquet(rows, root / "train.parquet")


def sft_args(sft_inputs, run_dir, steps):
    model_dir, train_file = sft_inputs
    return ["sft", "data.multiturn.enable=true", f"data.train_files={train_file}", "data.max_length=64",
            f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]",
            "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1"]


def test_sft_resume_steps_back_past_a_damaged_checkpoint_and_exits_2_when_none_loads(sft_inputs, tmp_path, capsys,
                                                                                      caplog):
    run_dir = tmp_path / "run"
    assert ember_main(sft_args(sft_inputs, run_dir, 2)) == 0
    cut_short(run_dir / "global_step_2" / "rng_state.pt")
    with caplog.at_level(logging.WARNING, logger="ember.trainer"):
        assert ember_main(sft_args(sft_inputs, run_dir, 3)) == 0  # from step 1: steps 2 and 3
    assert any(f"checkpoint {run_dir / 'global_step_2'} cannot be loaded" in record.message
               and f"resuming from {run_dir / 'global_step_1'} instead" in record.message for record in caplog.records)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # step 2 once: the resumed run's

    for step in (1, 2, 3):
        os.remove(run_dir / f"global_step_{step}" / "actor" / "engine_state.json")
    capsys.readouterr()
    assert ember_main(sft_args(sft_inputs, run_dir, 4)) == 2
    error = printed_error(capsys)
    assert error.startswith(f"error: none of the 3 checkpoint(s) in {run_dir} can be loaded:\n"
                            f"  - {run_dir / 'global_step_3'}: {run_dir / 'global_step_3'}/actor/engine_state.json is missing")
