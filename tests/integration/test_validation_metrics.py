"""Validation in the RL loop: `data.val_batch_size` sets the prompts per rollout call, and reward
errors and timeouts on validation samples are counted in the validation metrics while
validation still completes."""

from __future__ import annotations

import pytest
from rl_helpers import DATA_SOURCE, TEST_SIZE, TRAIN_SIZE, build_trainer, close, metrics_by_step, run_overrides

from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.trainer.validation import validate, validation_sampling

SLOW_ANSWER = 83  # the validation row with this answer takes SLOW_S to score: a timeout
SLOW_S = 5  # past the run's reward_model.timeout_s=1.0, within the default 10 s: only the configured one fires

FAILING_REWARD = f'''
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        raise ValueError(f"this test reward refuses even answers ({{ground_truth}})")
    if int(ground_truth) == {SLOW_ANSWER}:
        time.sleep({SLOW_S})
    return 0.5
'''


def count_rollout_calls(trainer) -> list[int]:
    """Prompts per `generate` call of the trainer's rollout, recorded from now on."""
    calls = []
    generate = trainer.parts.rollout.generate

    def recording(prompt_ids, sampling, **options):
        calls.append(len(prompt_ids))
        return generate(prompt_ids, sampling, **options)

    trainer.parts.rollout.generate = recording
    return calls


def test_val_batch_size_and_reward_failures_in_validation_metrics(inputs, tmp_path):
    answers = [int(row["reward_model"]["ground_truth"])
               for row in make_arithmetic_splits("add2", TRAIN_SIZE, TEST_SIZE, seed=0)["test"]]
    assert SLOW_ANSWER in answers
    even = sum(answer % 2 == 0 for answer in answers)
    assert 0 < even < TEST_SIZE - 1

    reward_file = tmp_path / "failing_reward.py"
    reward_file.write_text(FAILING_REWARD)
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, f"custom_reward_function.path={reward_file}",
                                          "trainer.val_only=True", "data.val_batch_size=5",
                                          "reward_model.num_workers=1", "reward_model.timeout_s=1.0",
                                          "reward_model.failure_score=-1.0"))
    calls = count_rollout_calls(trainer)
    try:
        metrics = trainer.fit()
        assert calls == [5, 5, 5, 1]  # 16 validation prompts in batches of data.val_batch_size
        assert metrics["val/reward_errors"] == even  # summed over the four batches
        assert metrics["val/reward_timeouts"] == 1
        # Validation completed: every sample scored, the failed ones with failure_score.
        expected_score = ((TEST_SIZE - even - 1) * 0.5 - (even + 1)) / TEST_SIZE
        assert metrics[f"val-aux/{DATA_SOURCE}/score"] == pytest.approx(expected_score)
        assert metrics_by_step(run_dir)[0]["val/reward_errors"] == even  # logged with the validation record

        # With data.val_batch_size null, one rollout call takes every prompt (up to 512).
        calls.clear()
        parts = trainer.parts
        sampling = validation_sampling(trainer.cfg.actor_rollout_ref.rollout.val_kwargs, 8, parts.eos_token_ids, seed=0)
        metrics, _ = validate(parts.rollout, parts.val_dataset, parts.reward_manager, parts.tokenizer, sampling,
                              parts.eos_token_ids, batch_size=None)
        assert calls == [TEST_SIZE]
        assert (metrics["val/reward_errors"], metrics["val/reward_timeouts"]) == (even, 1)
    finally:
        close(trainer)
