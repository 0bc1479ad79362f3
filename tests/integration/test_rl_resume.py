"""Resuming RL runs: a run killed after a checkpoint and resumed ends exactly where an
uninterrupted run ends; resume modes pick the right starting point; the resumed run's
metrics (metrics.jsonl, TensorBoard) hold each step once."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ember.cli import main as ember_main
from rl_helpers import (
    DATA_SOURCE,
    build_trainer,
    close,
    kill_after_checkpoint_2,
    engine_weights,
    fit,
    hf_weights,
    logged_training_steps,
    metrics_by_step,
    NOT_REPRODUCIBLE,
    run_overrides,
    STATEFUL_RUN,
    train,
)

VALIDATION_METRIC = f"val-core/{DATA_SOURCE}/acc"


@pytest.mark.slow
def test_killed_and_resumed_run_equals_the_uninterrupted_run(inputs, tmp_path):
    uninterrupted_dir, killed_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    train(run_overrides(inputs, uninterrupted_dir, *STATEFUL_RUN))

    # The same run as `ember train`, killed while it scores step 3 (its reward hangs once step 2 is saved).
    overrides = run_overrides(inputs, killed_dir, *STATEFUL_RUN)
    kill_after_checkpoint_2(overrides, killed_dir, tmp_path / "killed.log")
    assert sorted(metrics_by_step(killed_dir)) == [0, 1, 2]

    resumed = train(overrides + ["trainer.resume_mode=auto"])
    assert resumed.step == 4
    assert logged_training_steps(killed_dir) == [1, 2, 3, 4]  # steps 1-2 by the killed run, 3-4 resumed

    expected, actual = metrics_by_step(uninterrupted_dir), metrics_by_step(killed_dir)
    assert sorted(actual) == sorted(expected) == [0, 1, 2, 3, 4]
    for step in expected:
        keys = {key for key in expected[step] if not key.startswith(NOT_REPRODUCIBLE)}
        assert keys == {key for key in actual[step] if not key.startswith(NOT_REPRODUCIBLE)}, step
        for key in keys:
            assert actual[step][key] == pytest.approx(expected[step][key], abs=1e-6, rel=1e-6), (step, key)
    assert expected[4]["actor/lr"] > expected[3]["actor/lr"]  # the warmup schedule is part of what resumed
    assert expected[4]["actor/reward_kl_coef"] != 0.05  # and so is the adaptive KL coefficient

    final, resumed_final = hf_weights(uninterrupted_dir / "hf_model"), hf_weights(killed_dir / "hf_model")
    for name, tensor in final.items():
        torch.testing.assert_close(resumed_final[name], tensor, atol=1e-6, rtol=0)


def test_resume_modes_choose_the_starting_point(inputs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = run_overrides(inputs, run_dir, "trainer.total_training_steps=2", "trainer.val_before_train=False")
    train(overrides)
    initial, trained = hf_weights(inputs.model_dir), hf_weights(run_dir / "hf_model")

    def resumed_trainer(*mode: str, expected_step: int, expected_weights) -> None:
        trainer = build_trainer(overrides + list(mode))
        trainer.resume()
        close(trainer)
        assert trainer.step == expected_step, mode
        assert trainer.parts.train_loader.state_dict()["position"] == expected_step, mode
        weights = engine_weights(trainer.parts.actor.in_process().engine)
        assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights), mode

    resumed_trainer("trainer.resume_mode=auto", expected_step=2, expected_weights=trained)

    trainer = build_trainer(overrides + ["trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={run_dir / 'global_step_2'}"])
    trainer.resume()
    close(trainer)
    assert trainer.step == 2

    # val_only validates the resumed policy (not only a fresh one) and trains nothing.
    trainer = build_trainer(overrides + ["trainer.val_only=True", "trainer.val_before_train=False"])
    assert f"val-core/{DATA_SOURCE}/acc" in fit(trainer)
    assert trainer.step == 2 and len(list(run_dir.glob("global_step_*"))) == 1

    capsys.readouterr()
    for bad_path in (run_dir / "global_step_9", run_dir):  # missing; not a global_step_N folder
        status = ember_main(["train", *overrides, "trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={bad_path}"])
        assert status == 2
        error = capsys.readouterr().err
        assert "trainer.resume_from_path" in error and str(bad_path) in error and "global_step_N" in error

    # disable starts from the model itself; in this folder only when told to replace the run in it (test_run_folder.py)
    resumed_trainer("trainer.resume_mode=disable", "trainer.overwrite_default_local_dir=true", expected_step=0,
                    expected_weights=initial)
    assert not list(run_dir.glob("global_step_*"))


def test_a_resumed_run_logs_each_step_once(inputs, tmp_path):
    run_dir = tmp_path / "run"
    overrides = run_overrides(inputs, run_dir, "trainer.save_freq=2")
    train(overrides)
    shutil.rmtree(run_dir / "global_step_3")  # as if killed after logging step 3, before its checkpoint
    time.sleep(1.1)  # TensorBoard orders event files by the second they were created in
    resumed = train(overrides)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "actor/pg_loss" in record] == [1, 2, 3]
    assert [record["step"] for record in records if VALIDATION_METRIC in record] == [0, 3]
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    for tag, steps in (("actor/pg_loss", [1, 2, 3]), (VALIDATION_METRIC, [0, 3])):
        assert [event.step for event in accumulator.Scalars(tag)] == steps, tag
    step_3 = next(record for record in records if record["step"] == 3 and "actor/pg_loss" in record)
    assert accumulator.Scalars("actor/grad_norm")[-1].value == pytest.approx(step_3["actor/grad_norm"])
    assert resumed.step == 3


def test_del_local_ckpt_after_load_deletes_the_checkpoint_the_run_resumed_from(inputs, tmp_path, caplog):
    from ember.trainer.checkpoint import list_checkpoints

    run_dir = tmp_path / "run"
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=1", "trainer.save_freq=1"))
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [1]
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=3",
                        "trainer.resume_mode=auto", "trainer.del_local_ckpt_after_load=true"))
    assert "resumed from" in caplog.text and "deleted" in caplog.text
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [3]  # step 1's folder is gone
    assert [step for step in sorted(metrics_by_step(run_dir)) if step > 0] == [1, 2, 3]
