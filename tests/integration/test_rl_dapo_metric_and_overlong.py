"""DAPO at the trainer level, where the two of its settings that the default tiny run cannot tell
apart show: `algorithm.filter_groups.metric` (a reward whose score varies within every group but
whose accuracy does not for even answers) and the overlong penalty measuring the response alone
(prompts of different lengths, responses ending at different lengths: `varied_lengths.py`)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from rl_helpers import build_trainer, fit, run_overrides
from varied_lengths import VARIED_RUN, record_updates, rewards_of_responses, trained_scores, varied_inputs

# score: a hash of the text, so the samples of a prompt differ; acc: 1 for every sample of an even
# answer (no spread: dropped when filtering on acc), the score otherwise.
ACC_ALIKE_FOR_EVEN_ANSWERS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = (sum(map(ord, solution_str)) % 7) / 6
    return {"score": score, "acc": 1.0 if int(ground_truth) % 2 == 0 else score}
'''


def is_even(ground_truth) -> bool:
    return int(ground_truth) % 2 == 0


@pytest.mark.parametrize("metric", ["acc", "score"])
def test_dynamic_sampling_filters_groups_on_the_configured_metric(metric, inputs, tmp_path):
    reward_file = tmp_path / "acc_reward.py"
    reward_file.write_text(ACC_ALIKE_FOR_EVEN_ANSWERS)
    trainer = build_trainer(run_overrides(
        inputs, tmp_path / "run", f"custom_reward_function.path={reward_file}", "reward_model.reward_manager=dapo",
        "algorithm.filter_groups.enable=True", f"algorithm.filter_groups.metric={metric}",
        "algorithm.filter_groups.max_num_gen_batches=10", "data.gen_batch_size=4", "trainer.total_training_steps=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1"))
    rounds = []  # (ground truth, score) of every sample each generation round scored
    score_round = trainer.score_round

    def recording_score_round(experience):
        scored = score_round(experience)
        rounds.append(list(zip(experience.batch.uids, experience.batch.ground_truths, scored.scores.tolist())))
        return scored

    trainer.score_round = recording_score_round
    batches = record_updates(trainer)
    fit(trainer)
    scores_of_even_groups = defaultdict(list)
    for samples in rounds:
        for uid, truth, score in samples:
            if is_even(truth):
                scores_of_even_groups[uid].append(score)
    # even answers' groups that filtering on the score keeps (their scores vary) but filtering on acc drops
    assert any(max(scores) > min(scores) for scores in scores_of_even_groups.values())
    (batch,) = batches
    assert len(set(batch.uids)) == 4
    trained_even = [truth for truth in batch.ground_truths if is_even(truth)]
    if metric == "acc":
        assert trained_even == [] and len(rounds) > 1  # dropped, and more prompts generated to replace them
    else:
        assert trained_even


def overlong_penalty_of(response_length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's penalty, written out: 0 up to max_length − buffer, then linear down to −factor at max_length."""
    return min(0.0, -(response_length - (max_length - buffer)) / buffer * factor)


def test_overlong_penalty_counts_the_response_tokens_alone(inputs, tmp_path):
    varied = varied_inputs(tmp_path / "varied", inputs)
    trainer = build_trainer(run_overrides(
        varied, tmp_path / "run", *VARIED_RUN, "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=6",
        "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=True",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "trainer.test_freq=-1"))
    batches = record_updates(trainer)
    fit(trainer)
    response_lengths, prompt_lengths = [], []
    for batch in batches:
        lengths = batch.response_mask.sum(dim=1).tolist()
        response_lengths += lengths
        prompt_lengths += (batch.attention_mask.sum(dim=1) - batch.response_mask.sum(dim=1)).tolist()
        rewards = rewards_of_responses(batch, trainer.parts.tokenizer, varied.reward_file)
        expected = [reward + overlong_penalty_of(length, 8, 6, 0.5) for reward, length in zip(rewards, lengths)]
        torch.testing.assert_close(trained_scores(batch), torch.tensor(expected, dtype=torch.float32),
                                   rtol=0, atol=1e-6)
    assert len(set(prompt_lengths)) >= 4  # prompts of several lengths
    assert min(response_lengths) <= 2 < max(response_lengths)  # some unpenalised, some penalised
