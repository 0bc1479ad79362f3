"""trainer.balance_batch really reordering a batch (two data-parallel ranks in Ray workers, prompts
and responses of different lengths: `varied_lengths.py`): every sample still trains with its own
reward when the rewards are computed in the background (`reward_model.launch_reward_fn_async`), and
each line of the rollout dump pairs a response with its own score and advantage."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from rl_helpers import build_trainer, fit, run_overrides
from varied_lengths import (VARIED_RUN, record_updates, reward_function, rewards_of_responses, trained_scores,
                            varied_inputs)

import ember.trainer.rl as rl_module

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module")
def balanced_async_run(inputs, tmp_path_factory, local_ray):
    """Two GRPO steps on two ranks with balancing, background scoring and a rollout dump; the run's
    inputs, its trainer, the batches its actor updated on and each step's balancing permutation."""
    directory = tmp_path_factory.mktemp("balanced-two-ranks")
    varied = varied_inputs(directory / "inputs", inputs)
    permutations = []
    balance_batch = rl_module.balance_batch

    def recording_balance_batch(batch, dp_size):
        balanced = balance_batch(batch, dp_size)
        permutations.append(balanced.permutation)
        return balanced

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rl_module, "balance_batch", recording_balance_batch)
        trainer = build_trainer(run_overrides(
            varied, directory / "run", *VARIED_RUN, "trainer.n_gpus_per_node=2", "trainer.balance_batch=True",
            "reward_model.launch_reward_fn_async=True", f"trainer.rollout_data_dir={directory / 'rollouts'}",
            f"trainer.total_training_steps={STEPS}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.val_before_train=False", "trainer.test_freq=-1"))
        batches = record_updates(trainer)
        fit(trainer)
    assert trainer.parts.actor.dp_size == 2 and trainer.reward_thread is not None
    assert len(permutations) == len(batches) == STEPS
    for permutation in permutations:
        # the samples really moved, and not by swaps alone: putting them back differs from moving them again
        assert permutation != sorted(permutation)
        assert any(permutation[permutation[i]] != i for i in range(len(permutation)))
    return varied, trainer, batches, directory / "rollouts"


def test_background_scores_follow_the_balanced_order(balanced_async_run):
    varied, trainer, batches, _ = balanced_async_run
    for batch in batches:
        own_rewards = torch.tensor(rewards_of_responses(batch, trainer.parts.tokenizer, varied.reward_file))
        assert len(set(own_rewards.tolist())) > 1
        torch.testing.assert_close(trained_scores(batch), own_rewards.float(), rtol=0, atol=1e-6)


def test_each_dumped_line_has_its_own_responses_score_and_advantage(balanced_async_run):
    varied, _, _, rollouts = balanced_async_run
    compute_score = reward_function(varied.reward_file)
    for step in range(1, STEPS + 1):
        records = [json.loads(line) for line in (rollouts / f"{step}.jsonl").read_text().splitlines()]
        assert len(records) == 4 * 4
        groups = defaultdict(list)
        for record in records:
            assert record["score"] == pytest.approx(compute_score(None, record["output"], record["gts"]), abs=1e-6)
            groups[record["input"]].append(record)
        assert sorted(map(len, groups.values())) == [4] * 4
        for group in groups.values():  # GRPO: the score's z-score within its prompt's group
            scores = torch.tensor([record["score"] for record in group], dtype=torch.float64)
            expected = (scores - scores.mean()) / (scores.std() + 1e-6)
            assert [record["advantage"] for record in group] == pytest.approx(expected.tolist(), abs=1e-5)
        assert any(record["advantage"] != 0 for record in records)
