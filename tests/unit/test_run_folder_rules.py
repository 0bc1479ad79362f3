"""Who may write in a run folder: a fresh start needs a folder without another run's checkpoints or
metrics (or `trainer.overwrite_default_local_dir`, which deletes them only once the run has started);
a run that continues the folder's run owns its past checkpoints; config.yaml is written only then."""

from __future__ import annotations

import pytest

from ember.config import ConfigError, load_config
from ember.trainer.checkpoint import CheckpointManager, list_checkpoints
from ember.trainer.run_folder import check_run_folder, claim_run_folder


def trainer_section(run_dir, *overrides: str):
    return load_config([f"trainer.default_local_dir={run_dir}", *overrides]).trainer


def test_an_unused_folder_takes_a_fresh_run(tmp_path):
    for mode in ("auto", "disable"):
        check_run_folder(trainer_section(tmp_path / "missing", f"trainer.resume_mode={mode}"), [])
    (tmp_path / "config.yaml").write_text("trainer: {}\n")  # a run that stopped before logging anything
    (tmp_path / "metrics.jsonl").write_text("")
    for mode in ("auto", "disable"):
        check_run_folder(trainer_section(tmp_path, f"trainer.resume_mode={mode}"), [])


def test_a_fresh_run_is_refused_where_another_run_left_checkpoints_or_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "actor/pg_loss": 0.5}\n')
    with pytest.raises(ConfigError, match="holds the metrics.jsonl of a run that wrote no checkpoint, and this run "
                                          r"starts fresh \(nothing to resume\)"):
        check_run_folder(trainer_section(tmp_path), [])
    check_run_folder(trainer_section(tmp_path, "trainer.overwrite_default_local_dir=true"), [])

    for step in (1, 2, 10):
        (tmp_path / f"global_step_{step}").mkdir()
    check_run_folder(trainer_section(tmp_path), [])  # auto: continues that run
    with pytest.raises(ConfigError, match=r"holds the checkpoints \(global_step_1 to global_step_10\) and the "
                                          r"metrics.jsonl of another run, and this run starts fresh "
                                          r"\(trainer.resume_mode=disable\)"):
        check_run_folder(trainer_section(tmp_path, "trainer.resume_mode=disable"), [])
    elsewhere = tmp_path / "elsewhere" / "global_step_3"
    elsewhere.mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"it resumes from {elsewhere}, outside the folder"):
        check_run_folder(trainer_section(tmp_path, "trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={elsewhere}"), [])
    check_run_folder(trainer_section(tmp_path, "trainer.resume_mode=resume_path",
                                     f"trainer.resume_from_path={tmp_path / 'global_step_2'}"), [])


def test_claiming_the_folder_deletes_the_previous_run_only_for_a_fresh_start(tmp_path):
    for name in ("global_step_1", "global_step_2", ".global_step_3.tmp", "hf_model"):
        (tmp_path / name).mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "config.yaml").write_text("the previous run's\n")

    continuing = CheckpointManager(str(tmp_path), keep=None)
    claim_run_folder(continuing, str(tmp_path / "global_step_2"), overwrite=False, config_yaml="resumed\n")
    assert continuing.resumed_step == 2 and (tmp_path / "global_step_1").is_dir()
    assert (tmp_path / "config.yaml").read_text() == "resumed\n" and (tmp_path / "metrics.jsonl").is_file()

    with pytest.raises(ConfigError, match="holds the checkpoints"):
        claim_run_folder(CheckpointManager(str(tmp_path), keep=None), None, overwrite=False, config_yaml="fresh\n")
    assert (tmp_path / "config.yaml").read_text() == "resumed\n"
    claim_run_folder(CheckpointManager(str(tmp_path), keep=None), None, overwrite=True, config_yaml="fresh\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.yaml", "hf_model"]
    assert (tmp_path / "config.yaml").read_text() == "fresh\n"


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside_for_auto_to_skip(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"global_step_{step}").mkdir()
        (tmp_path / f"global_step_{step}" / "marker").write_text(str(step))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    (tmp_path / "config.yaml").write_text("the run that wrote steps 3 and 4\n")

    continuing = CheckpointManager(str(tmp_path), keep=None)
    claim_run_folder(continuing, str(tmp_path / "global_step_2"), overwrite=False, config_yaml="resumed at 2\n")
    aside = tmp_path / "superseded_after_step_2"
    assert [step for step, _ in list_checkpoints(str(tmp_path))] == [1, 2]  # what auto would resume from: step 2
    assert continuing.resume_candidates("auto", None)[0] == str(tmp_path / "global_step_2")
    assert sorted(path.name for path in aside.iterdir()) == ["config.yaml", "global_step_3", "global_step_4"]
    assert (aside / "global_step_4" / "marker").read_text() == "4"  # nothing lost
    assert (aside / "config.yaml").read_text() == "the run that wrote steps 3 and 4\n"  # for `ember export` there
    assert (tmp_path / "config.yaml").read_text() == "resumed at 2\n"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"

    (tmp_path / "global_step_3").mkdir()  # the new line's step 3, then a resume from step 2 again
    claim_run_folder(CheckpointManager(str(tmp_path), keep=None), str(tmp_path / "global_step_2"), overwrite=False,
                     config_yaml="resumed at 2 again\n")
    assert (tmp_path / "superseded_after_step_2_2" / "global_step_3").is_dir() and (aside / "global_step_3").is_dir()
