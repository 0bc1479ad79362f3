"""DAPO in verl's form on a tiny CPU run: dynamic sampling (groups that all scored alike are
dropped and more prompts generated), overlong reward shaping, and the round limit's error."""

from __future__ import annotations

import pytest

from ember.errors import UserError
from rl_helpers import metrics_by_step, run_overrides, train

# acc: 1 for every sample of a prompt whose answer is even (no spread: the group is dropped),
# the hash of the text otherwise (samples differ: kept). With all_alike=True no group varies.
DAPO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, all_alike=False):
    if all_alike or int(ground_truth) % 2 == 0:
        return {"score": 1.0, "acc": 1.0}
    value = (sum(map(ord, solution_str)) % 7) / 6
    return {"score": value, "acc": value}
'''


def dapo_overrides(inputs, tmp_path, *extra):
    reward_file = tmp_path / "dapo_reward.py"
    reward_file.write_text(DAPO_REWARD)
    return run_overrides(
        inputs, tmp_path / "run", f"custom_reward_function.path={reward_file}",
        "data.gen_batch_size=4", "data.train_batch_size=4", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
        "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
        "reward_model.overlong_buffer.log=True", "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=10.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "trainer.total_training_steps=2", *extra)


def test_dapo_keeps_generating_until_a_step_has_its_groups_and_shapes_long_answers(inputs, tmp_path):
    rollouts = tmp_path / "rollouts"
    train(dapo_overrides(inputs, tmp_path, f"trainer.rollout_data_dir={rollouts}"))
    metrics = metrics_by_step(tmp_path / "run")
    for step in (1, 2):
        # about half the prompts have even answers, so one round of 4 rarely keeps 4 groups
        assert metrics[step]["batch/num_gen_batches"] >= 1
        assert metrics[step]["batch/kept_groups"] >= 4
        assert metrics[step]["batch/kept_group_fraction"] <= 1.0
        assert metrics[step]["reward/overlong_reward/mean"] <= 0.0
        assert 0.0 <= metrics[step]["reward/overlong/mean"] <= 1.0
    assert sum(metrics[step]["batch/num_gen_batches"] for step in (1, 2)) > 2  # some step needed more rounds
    import json

    records = [json.loads(line) for line in (rollouts / "1.jsonl").read_text().splitlines()]
    assert len(records) == 16  # train_batch_size groups of n = 4, whatever the rounds generated
    for record in records:  # kept groups vary in acc; the score is acc plus the overlong penalty
        assert int(record["gts"]) % 2 == 1
        assert record["score"] == pytest.approx(record["acc"] + record["overlong_reward"], abs=1e-6)


def test_too_many_rounds_without_spread_stop_naming_the_setting(inputs, tmp_path):
    with pytest.raises(UserError, match=r"3 generation rounds \(max_num_gen_batches=3\) kept 0 of the 4 prompt "
                                        r"groups .* too hard or too easy"):
        train(dapo_overrides(inputs, tmp_path, "algorithm.filter_groups.max_num_gen_batches=3",
                             "+custom_reward_function.reward_kwargs.all_alike=True"))
