"""Rollout tensor parallelism (`actor_rollout_ref.rollout.tensor_model_parallel_size`): ember's generation
engine split over two gloo ranks against the whole engine (tokens and log-probs, greedy and sampled, after a
weight update; dense and MoE models), and a GRPO run whose rollout spans both ranks against one whose ranks each
generate their own share: the same samples, so every metric of both steps."""

from __future__ import annotations

import os

import pytest

from rl_helpers import NOT_REPRODUCIBLE, metrics_by_step, run_overrides, train
from two_ranks import run_two_ranks

pytestmark = pytest.mark.slow


def test_the_engine_split_over_two_ranks_generates_what_the_whole_engine_does(tmp_path):
    run_two_ranks(os.path.join(os.path.dirname(__file__), "rollout_tp_worker.py"), str(tmp_path), timeout=300)
    assert (tmp_path / "done").read_text() == "ok"


def test_grpo_with_the_rollout_split_over_two_ranks_equals_one_engine_per_rank(inputs, tmp_path, local_ray):
    common = ["trainer.n_gpus_per_node=2", "trainer.device=cpu", "actor_rollout_ref.rollout.name=ember",
              "trainer.total_training_steps=2", "trainer.val_before_train=False", "trainer.test_freq=-1"]
    train(run_overrides(inputs, tmp_path / "dp", *common))
    split = train(run_overrides(inputs, tmp_path / "tp", *common, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    assert split.parts.rollout.dp_size == 1 and split.parts.actor.dp_size == 2
    expected, got = metrics_by_step(tmp_path / "dp"), metrics_by_step(tmp_path / "tp")
    for step in (1, 2):
        compared = [key for key in expected[step] if not key.startswith(NOT_REPRODUCIBLE)]
        assert "critic/score/mean" in compared and "actor/grad_norm" in compared
        for key in compared:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)
