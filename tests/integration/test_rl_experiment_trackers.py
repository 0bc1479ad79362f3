"""An RL run with `trainer.logger=['console','wandb']`, as verl scripts write it, in wandb's
offline mode (no account, nothing sent): the run is named by trainer.project_name and
trainer.experiment_name, holds the resolved config, and every step's metrics equal those of
metrics.jsonl. Skipped where wandb is not installed (CI installs only `.[test]`)."""

from __future__ import annotations

import pytest

from rl_helpers import metrics_by_step, run_overrides, train
from tracker_files import read_offline_wandb_run


def test_rl_run_logs_to_wandb_offline(inputs, offline_wandb):
    run_dir = offline_wandb / "run"
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=2", "trainer.val_before_train=false",
                        "trainer.project_name=ember-tests", "trainer.experiment_name=tiny-grpo",
                        "trainer.logger=['console','wandb']"))
    run = read_offline_wandb_run(offline_wandb)
    assert (run.project, run.name) == ("ember-tests", "tiny-grpo")
    assert run.config["trainer"]["logger"] == ["console", "wandb"]
    assert run.config["actor_rollout_ref"]["rollout"]["n"] == 4
    jsonl = metrics_by_step(run_dir)
    assert sorted(run.history) == sorted(jsonl) == [1, 2]
    for step, metrics in jsonl.items():
        logged = {key: value for key, value in metrics.items() if key != "step"}
        assert {key: run.history[step][key] for key in logged} == pytest.approx(logged)
