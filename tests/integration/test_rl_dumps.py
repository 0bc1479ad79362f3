"""`trainer.rollout_data_dir` and `trainer.validation_data_dir`: each step's and each validation's
generations as jsonl, in verl's fields, with the step's rewards and GRPO advantages."""

from __future__ import annotations

import json

import pytest

from rl_helpers import run_overrides, train


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollouts_and_validations_are_dumped_with_scores_and_advantages(inputs, tmp_path):
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    train(run_overrides(inputs, tmp_path / "run", "trainer.total_training_steps=2", "trainer.balance_batch=true",
                        f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={validations}",
                        "trainer.val_before_train=true", "trainer.test_freq=2"))
    assert sorted(path.name for path in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(path.name for path in validations.iterdir()) == ["0.jsonl", "2.jsonl"]
    records = read_lines(rollouts / "1.jsonl")
    assert len(records) == 4 * 4  # train_batch_size × n
    assert set(records[0]) >= {"input", "output", "gts", "score", "step", "advantage"}
    assert all(record["step"] == 1 for record in records)
    for start in range(0, len(records), 4):  # GRPO: the score's z-score within its prompt's group
        group = records[start:start + 4]
        assert len({record["input"] for record in group}) == 1
        scores = [record["score"] for record in group]
        mean = sum(scores) / 4
        std = (sum((score - mean) ** 2 for score in scores) / 3) ** 0.5
        for record in group:
            assert record["advantage"] == pytest.approx((record["score"] - mean) / (std + 1e-6), abs=1e-4)
    validation = read_lines(validations / "0.jsonl")
    assert len(validation) == 16 and all(record["step"] == 0 and "advantage" not in record for record in validation)
