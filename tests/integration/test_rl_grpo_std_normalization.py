"""`algorithm.norm_adv_by_std_in_grpo` reaches the advantages a trainer step trains on: with false
(Dr. GRPO) each sample's advantage is its score minus its group's mean score, exactly; with true
that difference is divided by the group's std (+ 1e-6)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from rl_helpers import build_trainer, fit, run_overrides
from varied_lengths import record_updates, trained_scores


@pytest.mark.parametrize("divide_by_std", [False, True])
def test_each_samples_advantage_is_its_score_minus_its_group_mean_divided_by_the_std_only_if_asked(
        divide_by_std, inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "trainer.total_training_steps=1",
                                          "trainer.val_before_train=False", "trainer.test_freq=-1",
                                          f"algorithm.norm_adv_by_std_in_grpo={divide_by_std}"))
    batches = record_updates(trainer)
    fit(trainer)
    (batch,) = batches
    scores = trained_scores(batch).double()
    rows_of_group = defaultdict(list)
    for row, uid in enumerate(batch.uids):
        rows_of_group[uid].append(row)
    assert sorted(map(len, rows_of_group.values())) == [4] * 4  # 4 prompts × rollout.n = 4
    std_changes_advantages = False
    for rows in rows_of_group.values():
        group_scores = scores[rows]
        mean, std = group_scores.mean(), group_scores.std()  # unbiased, as GRPO's
        std_changes_advantages |= bool((group_scores != mean).any() and 0.05 < std < 0.95)
        for row in rows:
            expected = (scores[row] - mean) / (std + 1e-6) if divide_by_std else scores[row] - mean
            advantages = batch.advantages[row][batch.response_mask[row].bool()]
            assert advantages.tolist() == pytest.approx([expected.item()] * len(advantages), abs=1e-6), (rows, row)
            assert torch.equal(batch.advantages[row][~batch.response_mask[row].bool()],
                               torch.zeros_like(batch.advantages[row][~batch.response_mask[row].bool()]))
    assert std_changes_advantages  # some group's std is far enough from 1 that dividing by it shows
