"""trainer.balance_batch in the RL loop: at one data-parallel rank it changes nothing but adds its
metric; a real reordering (as for 4 ranks) leaves the step's result unchanged, because every
per-sample input of the advantages and losses (uids, ReMax baselines) follows the permutation."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import hf_weights, metrics_by_step, run_overrides, train

import ember.trainer.rl as rl_module
from ember.trainer.balance import BalancedBatch

COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean", "critic/advantages/max",
            "critic/score/mean")


def one_step(inputs, run_dir, *extra):
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=1", "trainer.val_before_train=False",
                        "trainer.test_freq=-1", *extra))
    return metrics_by_step(run_dir)[1], hf_weights(run_dir / "hf_model")


def test_one_rank_is_an_exact_no_op_that_reports_the_metric(inputs, tmp_path):
    plain_metrics, plain_weights = one_step(inputs, tmp_path / "off", "trainer.balance_batch=False")
    metrics, weights = one_step(inputs, tmp_path / "on", "trainer.balance_batch=True")
    assert "batch/balance_max_over_mean_after" not in plain_metrics
    assert metrics["batch/balance_max_over_mean_before"] == metrics["batch/balance_max_over_mean_after"] == 1.0
    assert all(metrics[key] == plain_metrics[key] for key in COMPARED)
    assert all(torch.equal(weights[name], plain_weights[name]) for name in plain_weights)


@pytest.mark.parametrize("estimator", ["grpo", "remax"])
def test_a_reordered_batch_trains_like_the_original_order(estimator, inputs, tmp_path, monkeypatch):
    permutations = []

    def reorder_in_reverse(batch, dp_size):  # as a reordering for several ranks would, only surely moving
        permutation = list(reversed(range(len(batch))))
        permutations.append(permutation)
        return BalancedBatch(batch=batch.select(permutation), permutation=permutation, metrics={})

    plain_metrics, plain_weights = one_step(inputs, tmp_path / "off", "trainer.balance_batch=False",
                                            f"algorithm.adv_estimator={estimator}")
    monkeypatch.setattr(rl_module, "balance_batch", reorder_in_reverse)
    metrics, weights = one_step(inputs, tmp_path / "on", f"algorithm.adv_estimator={estimator}")
    (permutation,) = permutations
    assert permutation != sorted(permutation)  # the samples really moved
    for key in COMPARED:
        assert metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, atol=1e-5, rtol=0, msg=name)
