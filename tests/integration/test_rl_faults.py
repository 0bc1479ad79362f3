"""Faults an RL run must survive or report: SIGTERM (checkpoint and clean exit), non-finite
losses (skipped updates, then a stop), diverged losses (no checkpoint of their weights, then a
stop naming the last sound one), and bad inputs (a clear error before any work)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ember.cli import main as ember_main
from ember.trainer.checkpoint import list_checkpoints
from ember.trainer.export import export_checkpoint
from ember.trainer.faults import BadStepsError, StopRequest
from rl_helpers import (
    DATA_SOURCE,
    build_trainer,
    ember_train_process,
    engine_weights,
    fit,
    hf_weights,
    logged_training_steps,
    metrics_by_step,
    run_overrides,
    train,
    wait_for,
)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resumes(inputs, tmp_path):
    run_dir = tmp_path / "run"
    # 40 slow steps (the reward sleeps), no periodic checkpoints: only the stop writes one.
    run = ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False"]
    log_path = tmp_path / "ember.log"
    overrides = run_overrides(inputs, run_dir, *run, "trainer.total_training_steps=40",
                              "+custom_reward_function.reward_kwargs.sleep_s=0.02")
    with ember_train_process(overrides, log_path) as process:
        wait_for(lambda: len(logged_training_steps(run_dir)) >= 2, process, log_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-4000:]

    stopped = logged_training_steps(run_dir)[-1]
    assert 2 <= stopped < 40
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [stopped]
    assert f"stopping at step {stopped} on SIGTERM" in log_path.read_text()
    assert not (run_dir / "hf_model").exists()  # the run did not finish

    trainer = train(run_overrides(inputs, run_dir, *run, f"trainer.total_training_steps={stopped + 2}"))
    assert trainer.step == stopped + 2
    # The resumed run went on after the stop; a restarted one would have logged steps from 1 again.
    assert logged_training_steps(run_dir) == list(range(1, stopped + 3))
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [stopped, stopped + 2]
    assert (run_dir / "hf_model" / "model.safetensors").is_file()


def test_a_stop_requested_during_the_last_step_still_finishes_the_run(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=2",
                                          "trainer.val_before_train=False"))
    update = trainer.parts.actor.update

    def update_then_receive_sigterm(batch, step):
        if step == 2:
            assert isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), StopRequest)
            os.kill(os.getpid(), signal.SIGTERM)  # handled: only sets the stop request
        return update(batch, step)

    trainer.parts.actor.update = update_then_receive_sigterm
    handler_before = signal.getsignal(signal.SIGTERM)
    final_metrics = fit(trainer)
    assert f"val-core/{DATA_SOURCE}/acc" in final_metrics
    assert (run_dir / "hf_model" / "model.safetensors").is_file()
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_ctrl_c_during_the_first_validation_stops_before_step_1(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=2",
                                          "trainer.val_before_train=True"))
    validate = trainer.validate

    def validate_then_receive_sigint():
        os.kill(os.getpid(), signal.SIGINT)  # handled: only sets the stop request
        return validate()

    trainer.validate = validate_then_receive_sigint
    assert fit(trainer) == {}
    assert trainer.step == 0 and list_checkpoints(str(run_dir)) == []


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_non_finite_losses_skip_updates_and_three_in_a_row_stop_the_run(role, inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=10", "trainer.save_freq=2",
                                          "trainer.val_before_train=False", "algorithm.adv_estimator=gae"))
    worker = getattr(trainer.parts, role).in_process()
    finite_loss = worker._loss
    nan_steps = {3, 5, 6, 7}

    def loss_that_goes_nan(output, batch, context):
        loss, metrics = finite_loss(output, batch, context)
        return (loss * float("nan"), metrics) if trainer.step in nan_steps else (loss, metrics)

    worker._loss = loss_that_goes_nan
    with pytest.raises(BadStepsError) as stopped:
        fit(trainer)
    assert str(stopped.value).startswith("3 updates in a row were bad (last at step 7: a non-finite loss or gradient "
                                         f"norm, update skipped); the last sound checkpoint is {run_dir / 'global_step_6'}")

    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7]
    assert [steps[step][f"{role}/skipped"] for step in steps] == [0, 0, 1, 0, 1, 1, 1]
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2, 4, 6]
    current = engine_weights(worker.engine)
    assert all(torch.isfinite(tensor).all() for tensor in current.values())
    if role == "actor":  # skipped updates leave the weights alone: still those of step 4's update
        after_step_4 = hf_weights(export_checkpoint(str(run_dir / "global_step_4"), str(tmp_path / "step4")))
        after_step_2 = hf_weights(export_checkpoint(str(run_dir / "global_step_2"), str(tmp_path / "step2")))
        assert all(torch.equal(current[name], after_step_4[name]) for name in after_step_4)
        assert any(not torch.equal(after_step_2[name], after_step_4[name]) for name in after_step_4)


def test_a_diverged_loss_keeps_its_weights_out_of_checkpoints_and_names_the_last_sound_one(inputs, tmp_path, caplog):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=10", "trainer.save_freq=2",
                                          "trainer.val_before_train=False"))
    worker = trainer.parts.actor.in_process()
    finite_loss = worker._loss
    diverged_steps = {3, 4, 5}

    def loss_that_blows_up(output, batch, context):  # finite: no NaN check would see it
        loss, metrics = finite_loss(output, batch, context)
        return (loss * 1e12, metrics) if trainer.step in diverged_steps else (loss, metrics)

    worker._loss = loss_that_blows_up
    with pytest.raises(BadStepsError) as stopped:
        fit(trainer)

    steps = metrics_by_step(run_dir)
    assert all(steps[step]["actor/grad_norm"] > 1e8 and steps[step]["actor/skipped"] == 0 for step in diverged_steps)
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]  # step 4's weights were not written
    sound = run_dir / "global_step_2"
    assert str(stopped.value).startswith("3 updates in a row were bad (last at step 5: actor/grad_norm=")
    assert f"above trainer.max_loss_or_grad_norm=1e+08); the last sound checkpoint is {sound}" in str(stopped.value)
    assert any(record.message.startswith("not writing the checkpoint of step 4: the weights are unsound since step 3: ")
               and record.message.endswith(f"the last sound checkpoint is {sound}") for record in caplog.records)


def test_a_run_that_ends_on_diverged_weights_exports_no_final_model_and_names_the_sound_checkpoint(inputs, tmp_path,
                                                                                                   caplog, capsys):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=2",
                                          "trainer.val_before_train=False"))
    worker = trainer.parts.actor.in_process()
    finite_loss = worker._loss

    def loss_that_blows_up_at_the_last_step(output, batch, context):  # one bad step: too few to stop the run
        loss, metrics = finite_loss(output, batch, context)
        return (loss * 1e12, metrics) if trainer.step == 3 else (loss, metrics)

    worker._loss = loss_that_blows_up_at_the_last_step
    fit(trainer)

    assert metrics_by_step(run_dir)[3]["actor/grad_norm"] > 1e8
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]
    assert not (run_dir / "hf_model").exists()  # the diverged weights are nobody's final model
    message = (f"final model not exported to {run_dir / 'hf_model'}: the weights are unsound since step 3: "
               "actor/grad_norm=")
    assert any(record.message.startswith(message) and record.message.endswith(
        f"the last sound checkpoint is {run_dir / 'global_step_2'}; `ember export CHECKPOINT_DIR OUT_DIR` writes it as "
        "a Hugging Face model") for record in caplog.records)
    assert message in capsys.readouterr().out


@pytest.mark.parametrize("key, missing", [
    ("actor_rollout_ref.model.path", "no-such-model"),
    ("data.train_files", "no-such-train.parquet"),
    ("data.val_files", "no-such-test.parquet"),
    ("custom_reward_function.path", "no_such_reward.py"),
])
def test_a_missing_input_is_a_clear_error_before_any_work(key, missing, inputs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    path = tmp_path / missing
    assert ember_main(["train", *run_overrides(inputs, run_dir, f"{key}={path}")]) == 2
    error = capsys.readouterr().err
    assert key in error and str(path) in error, error
    assert not run_dir.exists()  # nothing was built or written
