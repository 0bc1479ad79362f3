"""Rollout correction in a tiny CPU run (hf rollout, GRPO): with verl's keys on, the trainer
computes old log-probs even for one update per batch, the actor trains on the importance
weights and rejection mask that verl's functions give for the batch's own log-probs, and the
`rollout_corr/*` metrics are logged; with the correction off the mismatch is logged all the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rl_helpers import build_trainer, fit, metrics_by_step, run_overrides
from varied_lengths import record_updates

from ember.algorithms import compute_rollout_correction
from ember.config.rollout_correction import parse_rejection

KEY = "algorithm.rollout_correction"
STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.test_freq=-1"]


def skew_rollout_log_probs(trainer) -> None:
    """The hf rollout scores tokens as the actor does (a gap near 1e-7); an engine of other numerics is
    stood in for by lowering the log-prob it reports for every third token of every other sample by 0.5
    (ratio e^0.5 ≈ 1.65: truncated at 1.5, outside 0.9..1.1)."""
    generate = trainer.parts.rollout.generate

    def skewed(prompts, sampling, *args, **kwargs):
        outputs = generate(prompts, sampling, *args, **kwargs)
        return [replace(output, log_probs=[value - 0.5 if index % 2 == 0 and position % 3 == 0 else value
                                           for position, value in enumerate(output.log_probs)])
                for index, output in enumerate(outputs)]

    trainer.parts.rollout.generate = skewed


def test_a_run_with_correction_trains_on_verls_weights_and_mask_and_logs_the_mismatch(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, *STEP, f"{KEY}.rollout_is=token",
                                          f"{KEY}.rollout_is_threshold=1.5", f"{KEY}.rollout_rs=token_k1,seq_max_k2",
                                          f"{KEY}.rollout_rs_threshold='0.5_2.0,0.1'"))
    skew_rollout_log_probs(trainer)
    batches = record_updates(trainer)
    fit(trainer)
    (batch,) = batches
    assert batch.old_log_probs is not None and batch.rollout_log_probs is not None  # one update, still computed
    generated = batch.attention_mask[:, -batch.response_mask.shape[1]:]
    expected = compute_rollout_correction(
        batch.old_log_probs, batch.rollout_log_probs, generated, rollout_is="token", rollout_is_threshold=1.5,
        rollout_is_batch_normalize=False, rejection=parse_rejection("token_k1,seq_max_k2", "0.5_2.0,0.1"))
    torch.testing.assert_close(batch.rollout_is_weights, expected.weights)
    assert torch.equal(batch.response_mask, expected.response_mask)
    assert (batch.rollout_is_weights == 1.5).any()  # skewed tokens truncated
    rejected = (generated.sum(-1) > 0) & (batch.response_mask.sum(-1) == 0)
    assert 0 < rejected.sum() < len(batch)  # seq_max_k2: ½·0.5² = 0.125 > 0.1 vetoes the skewed samples
    metrics = metrics_by_step(run_dir)[1]
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl",
                "rollout_corr/k3_kl", "rollout_corr/log_prob_abs_diff_max", "training/rollout_probs_diff_mean"):
        assert key in metrics, key
    assert metrics["rollout_corr/rollout_is_mean"] == expected.metrics["rollout_corr/rollout_is_mean"]
    assert metrics["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == rejected.float().mean().item()
    assert metrics["response_length/mean"] == generated.sum(-1).float().mean().item()  # lengths as generated


def test_without_correction_the_actor_logs_the_mismatch_of_its_own_forward(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, *STEP))
    batches = record_updates(trainer)
    fit(trainer)
    (batch,) = batches
    assert batch.old_log_probs is None and batch.rollout_is_weights is None  # no extra forward
    metrics = metrics_by_step(run_dir)[1]
    assert 0 <= metrics["rollout_corr/log_prob_abs_diff_mean"] <= metrics["rollout_corr/log_prob_abs_diff_max"] < 1
    assert "rollout_corr/kl" in metrics and "training/rollout_actor_probs_pearson_corr" in metrics
    assert not any(key.startswith("actor/rollout_corr") for key in metrics)


def test_without_correction_several_updates_log_the_mismatch_against_the_old_log_probs(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, *STEP, "actor_rollout_ref.actor.ppo_mini_batch_size=2"))
    skew_rollout_log_probs(trainer)
    batches = record_updates(trainer)
    fit(trainer)
    (batch,) = batches
    assert batch.old_log_probs is not None and batch.rollout_is_weights is None
    generated = batch.attention_mask[:, -batch.response_mask.shape[1]:]
    assert torch.equal(batch.response_mask, generated)  # nothing rejected
    metrics = metrics_by_step(run_dir)[1]
    assert metrics["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert not any(key.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs")) for key in metrics)


def test_bypass_mode_trains_on_the_rollouts_log_probs_with_no_old_log_prob_forward(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, *STEP, f"{KEY}.bypass_mode=true",
                                          "actor_rollout_ref.actor.ppo_mini_batch_size=2"))  # two updates
    skew_rollout_log_probs(trainer)
    batches = record_updates(trainer)
    forwards = []
    compute_log_probs = trainer.parts.actor.compute_log_probs
    trainer.parts.actor.compute_log_probs = lambda batch: forwards.append(batch) or compute_log_probs(batch)
    actor = trainer.parts.actor.in_process()
    seen = []  # (the micro-batch, the inputs of its policy loss)
    loss, policy_loss = actor._loss, actor.policy_loss_fn
    actor._loss = lambda output, micro, context: seen.append([micro]) or loss(output, micro, context)
    actor.policy_loss_fn = lambda inputs, *args, **kwargs: seen[-1].append(inputs) or policy_loss(inputs, *args,
                                                                                                  **kwargs)
    fit(trainer)
    (batch,) = batches
    assert forwards == [] and torch.equal(batch.old_log_probs, batch.rollout_log_probs)
    micro, inputs = seen[0][:2]  # the first micro-batch of the first mini-batch: weights as generated
    assert torch.equal(inputs.old_log_probs, micro.rollout_log_probs)
    log_ratio = (inputs.log_probs - inputs.old_log_probs).detach()[micro.response_mask.bool()]
    near_zero, near_skew = (log_ratio.abs() < 1e-4), ((log_ratio - 0.5).abs() < 1e-4)
    assert (near_zero | near_skew).all() and near_skew.any()  # ratio exp(new − rollout): e^0.5 where skewed
    metrics = metrics_by_step(run_dir)[1]
    assert "timing_s/old_log_prob" not in metrics
    assert metrics["rollout_corr/log_prob_abs_diff_max"] > 0.4  # the actor's forward against the rollout
    assert metrics["actor/pg_clipfrac"] > 0  # e^0.5 is outside 1 ± 0.2
