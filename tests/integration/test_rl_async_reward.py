"""reward_model.launch_reward_fn_async: a step's scores are computed in the background while its reference
log-probs (and old log-probs, values) are, and the step trains exactly as with scoring in line."""

from __future__ import annotations

import threading

import pytest
import torch
from rl_helpers import build_trainer, fit, hf_weights, metrics_by_step, run_overrides, train

from ember.trainer.rl import RLTrainer

COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/advantages/mean",
            "critic/score/mean", "reward/errors")


def two_steps(inputs, run_dir, *extra):
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=2", "trainer.val_before_train=False",
                        "trainer.test_freq=-1", "actor_rollout_ref.actor.use_kl_loss=True",
                        "reward_model.num_workers=2", *extra))
    return metrics_by_step(run_dir), hf_weights(run_dir / "hf_model")


@pytest.mark.parametrize("estimator", ["grpo", "remax"])
def test_scoring_in_the_background_trains_as_scoring_in_line(estimator, inputs, tmp_path):
    in_line = two_steps(inputs, tmp_path / "in_line", f"algorithm.adv_estimator={estimator}")
    background = two_steps(inputs, tmp_path / "background", f"algorithm.adv_estimator={estimator}",
                           "reward_model.launch_reward_fn_async=True")
    for step in (1, 2):
        assert {key: background[0][step][key] for key in COMPARED if key in in_line[0][step]} == {
            key: in_line[0][step][key] for key in COMPARED if key in in_line[0][step]}
    assert all(torch.equal(background[1][name], in_line[1][name]) for name in in_line[1])


def test_the_scores_are_computed_while_the_reference_computes_its_log_probs(inputs, tmp_path, monkeypatch):
    reference_done = threading.Event()
    scoring_threads = []
    score_round = RLTrainer.score_round

    def score_after_the_reference(self, experience):
        scoring_threads.append(threading.current_thread())
        # in line, this would wait for a reference call that comes only after it: the wait would time out
        assert reference_done.wait(timeout=60), "the scores were wanted before the reference ran"
        return score_round(self, experience)

    monkeypatch.setattr(RLTrainer, "score_round", score_after_the_reference)
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "trainer.total_training_steps=1",
                                          "trainer.val_before_train=False", "trainer.test_freq=-1",
                                          "actor_rollout_ref.actor.use_kl_loss=True",
                                          "reward_model.launch_reward_fn_async=True"))
    compute_log_probs = trainer.parts.reference.compute_log_probs

    def reference_then_signal(batch):
        log_probs = compute_log_probs(batch)
        reference_done.set()
        return log_probs

    trainer.parts.reference.compute_log_probs = reference_then_signal
    fit(trainer)
    assert scoring_threads and all(thread is not threading.main_thread() for thread in scoring_threads)
    assert metrics_by_step(tmp_path / "run")[1]["critic/score/mean"] >= 0
