"""BadStepGuard: skipped and diverged updates are bad steps; only a diverged (applied) one makes
the weights unfit for a checkpoint, until a sound update; the messages name the last sound checkpoint."""

from __future__ import annotations

import pytest

from ember.trainer.faults import BadStepGuard

SOUND = {"actor/loss": 0.3, "actor/grad_norm": 2.0}


def test_a_finite_loss_or_grad_norm_beyond_the_bound_makes_the_weights_unsound_until_a_sound_update():
    guard = BadStepGuard(bound=1e6)
    guard.record(1, skipped=False, watched=SOUND)
    guard.last_sound_checkpoint = "run/global_step_1"
    guard.record(2, skipped=False, watched={"actor/loss": 0.3, "actor/grad_norm": 3e30})
    assert not guard.weights_sound and guard.in_a_row == 1
    assert guard.unsound_save_message(2) == (
        "not writing the checkpoint of step 2: the weights are unsound since step 2: actor/grad_norm=3e+30 above "
        "trainer.max_loss_or_grad_norm=1e+06; the last sound checkpoint is run/global_step_1")
    guard.record(3, skipped=True, watched={"actor/loss": float("nan"), "actor/grad_norm": float("nan")})
    assert not guard.weights_sound  # a skipped update changes nothing: still the diverged weights
    guard.record(4, skipped=False, watched={"actor/loss": -2e7, "actor/grad_norm": 1.0})  # a loss, in magnitude
    assert not guard.weights_sound and guard.should_stop
    assert guard.unsound_save_message(4).startswith("not writing the checkpoint of step 4: the weights are unsound "
                                                    "since step 2: actor/grad_norm=3e+30")
    assert guard.stop_message() == ("3 updates in a row were bad (last at step 4: actor/loss=-2e+07 above "
                                    "trainer.max_loss_or_grad_norm=1e+06); the last sound checkpoint is "
                                    "run/global_step_1")
    guard.record(5, skipped=False, watched=SOUND)
    assert guard.weights_sound and guard.in_a_row == 0 and guard.total == 3


def test_skipped_updates_are_bad_steps_that_leave_the_weights_sound():
    guard = BadStepGuard(bound=1e6)
    for step in (1, 2):
        guard.record(step, skipped=True, watched={"train/loss": float("inf"), "train/grad_norm": float("inf")})
    assert guard.weights_sound and guard.in_a_row == 2 and not guard.should_stop
    guard.record(3, skipped=True, watched={})
    assert guard.should_stop
    assert guard.stop_message() == ("3 updates in a row were bad (last at step 3: a non-finite loss or gradient norm, "
                                    "update skipped); no sound checkpoint has been written yet")


@pytest.mark.parametrize("value, bad", [(1e6, False), (1.0000001e6, True), (-1e9, True)])
def test_the_bound_is_exclusive_and_on_magnitude(value, bad):
    guard = BadStepGuard(bound=1e6)
    guard.record(1, skipped=False, watched={"critic/loss": value})
    assert guard.weights_sound is not bad and guard.in_a_row == int(bad)
