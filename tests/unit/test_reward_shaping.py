"""DAPO's overlong penalty and group filter against hand-computed cases."""

import pytest
import torch

from ember.algorithms.reward_shaping import groups_with_spread, overlong_penalty


def test_overlong_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    # limit 20, buffer 4: free up to 16 tokens, then −factor × (L − 16) / 4
    lengths = torch.tensor([3, 16, 17, 18, 20])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    with pytest.raises(ValueError, match="1..20"):
        overlong_penalty(lengths, 20, 0, 1.0)


def test_groups_whose_samples_all_scored_alike_are_dropped():
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    metric = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert groups_with_spread(uids, metric) == ["b", "c"]  # c: a group of one is kept
