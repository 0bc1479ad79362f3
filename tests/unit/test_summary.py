"""The accuracy table at the end of an RL run: each column is headed by the step it was measured at."""

from ember.trainer.summary import accuracy_table


def history(*steps):
    return [(step, {"val-core/mean/acc": step / 100, "val/other": 1.0}) for step in steps]


def test_first_and_last_validation_columns_name_their_steps():
    lines = accuracy_table(history(0, 20, 60), steps=60, seconds=100).splitlines()
    assert lines[0].split()[1:] == ["before", "training", "after", "step", "60"]
    assert lines[1].split() == ["val-core/mean/acc", "0.000", "0.600"]
    assert len(lines) == 4  # val-core rows only, then steps and time


def test_without_validation_before_training_the_first_column_is_the_first_step_validated():
    header = accuracy_table(history(20, 60), steps=60, seconds=100).splitlines()[0]
    assert header.split()[1:] == ["after", "step", "20", "after", "step", "60"]


def test_a_single_validation_is_one_column_named_by_its_step():
    lines = accuracy_table(history(60), steps=60, seconds=100).splitlines()
    assert lines[0].split()[1:] == ["after", "step", "60"]
    assert lines[1].split() == ["val-core/mean/acc", "0.600"]
