"""Token-budget micro-batch planning and padding trimming (ember/engines/micro_batches.py)."""

import random

import pytest
import torch

from ember.data.batch import Batch
from ember.engines.base import MicroBatchSpec
from ember.engines.micro_batches import (
    balanced_partition,
    min_micro_batch_count,
    pad_prompt_columns,
    plan_micro_batches,
    trim_columns,
    used_extents,
)


def token_sums(lengths, groups):
    return [sum(lengths[i] for i in group) for group in groups]


def assert_valid_plan(lengths, groups, budget):
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group, tokens in zip(groups, token_sums(lengths, groups)):
        assert group, groups
        assert tokens <= budget or len(group) == 1, (group, tokens, budget)


def test_hand_computed_plan():
    lengths = [7, 3, 5, 2, 6, 1]  # 24 tokens, budget 8: at least 3 micro-batches
    groups = plan_micro_batches(lengths, 8)
    assert groups == [[0, 5], [1, 2], [3, 4]]
    assert token_sums(lengths, groups) == [8, 8, 8]


@pytest.mark.parametrize("seed", range(200))
def test_random_plans_cover_every_sample_once_within_the_budget(seed):
    generator = random.Random(seed)
    lengths = [generator.randint(1, 60) for _ in range(generator.randint(1, 24))]
    budget = generator.randint(20, 120)
    needed = min_micro_batch_count(lengths, budget)
    for count in range(needed, len(lengths) + 1):  # another rank may need more micro-batches
        groups = plan_micro_batches(lengths, budget, count)
        assert len(groups) == count
        assert_valid_plan(lengths, groups, budget)


def test_the_count_is_the_fewest_possible_when_the_lower_bound_fits():
    lengths = [10] * 9 + [5, 5]  # 100 tokens
    assert min_micro_batch_count(lengths, 50) == 2
    assert min_micro_batch_count(lengths, 49) == 3
    assert min_micro_batch_count(lengths, 100) == 1


def test_over_long_sequences_get_their_own_micro_batch():
    lengths = [30, 4, 25, 3, 2]
    groups = plan_micro_batches(lengths, 10)
    assert [0] in groups and [2] in groups
    assert len(groups) == 3  # the 9 remaining tokens fit one micro-batch
    assert_valid_plan(lengths, groups, 10)


def test_the_count_argument_is_honoured_and_checked():
    lengths = [4, 4, 4, 4]
    assert len(plan_micro_batches(lengths, 16)) == 1
    groups = plan_micro_batches(lengths, 16, num_micro_batches=3)
    assert len(groups) == 3 and sorted(map(len, groups)) == [1, 1, 2]
    with pytest.raises(ValueError, match="between 2 and 4"):
        plan_micro_batches(lengths, 8, num_micro_batches=1)
    with pytest.raises(ValueError, match="between 1 and 4"):
        plan_micro_batches(lengths, 16, num_micro_batches=5)


def test_balance_beats_consecutive_splitting_on_a_skewed_batch():
    lengths = [60, 55, 50, 45, 8, 7, 6, 5]  # long responses first, as a sorted rollout might give them
    groups = plan_micro_batches(lengths, 120)
    assert len(groups) == 2
    naive = [list(range(0, 4)), list(range(4, 8))]  # the same count of fixed-size micro-batches
    assert max(token_sums(lengths, naive)) == 210  # over the budget, and 184 tokens apart
    assert token_sums(lengths, groups) == [118, 118]


def test_balanced_partition_fills_the_lightest_group():
    assert balanced_partition([5, 4, 3, 3], 2) == [[0, 3], [1, 2]]  # 5+3 and 4+3
    assert balanced_partition([1], 3) == [[0], [], []]


def test_bad_budgets_and_specs_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        min_micro_batch_count([3], 0)
    with pytest.raises(ValueError, match="exactly one"):
        MicroBatchSpec(size=2, max_token_len=100)
    with pytest.raises(ValueError, match="exactly one"):
        MicroBatchSpec()
    assert MicroBatchSpec.of(4) == MicroBatchSpec(size=4)


def padded_batch():
    """3 samples: prompts of 2, 1, 3 tokens (P = 5 after padding), responses of 1, 3, 2 tokens (R = 6)."""
    return Batch.from_rollout([[5, 6], [7], [8, 9, 10]], [[11], [12, 13, 14], [15, 16]], pad_token_id=0,
                              prompt_length=5, response_length=6,
                              rollout_log_probs=[[-1.0], [-2.0, -3.0, -4.0], [-5.0, -6.0]])


def test_used_extents_per_sample():
    assert used_extents(padded_batch()) == ([3, 4, 2], [1, 3, 2])


def test_trim_keeps_exactly_the_used_columns_of_every_field():
    batch = padded_batch()
    starts, ends = used_extents(batch)
    micro = batch.select([0, 2])
    trimmed = trim_columns(micro, min(starts[0], starts[2]), max(ends[0], ends[2]))
    assert (trimmed.prompt_length, trimmed.response_length) == (3, 2)
    assert trimmed.input_ids.tolist() == [[0, 5, 6, 11, 0], [8, 9, 10, 15, 16]]
    assert trimmed.position_ids.tolist() == micro.position_ids[:, 2:7].tolist()
    assert trimmed.response_mask.tolist() == [[1, 0], [1, 1]]
    assert trimmed.rollout_log_probs.tolist() == [[-1.0, 0.0], [-5.0, -6.0]]
    assert trimmed.attention_mask.sum() == micro.attention_mask.sum()  # no real token lost


def test_trim_keeps_the_last_prompt_column_and_one_response_column():
    batch = padded_batch()
    assert trim_columns(batch, 0, 6) is batch
    trimmed = trim_columns(batch, 9, 0)
    assert (trimmed.prompt_length, trimmed.response_length) == (1, 1)
    assert torch.equal(trimmed.input_ids, batch.input_ids[:, 4:6])


@pytest.mark.parametrize("multiple", [1, 2, 4, 5])
def test_padding_to_a_multiple_adds_masked_prompt_columns_and_changes_no_output(multiple):
    """Sequence parallelism's even split: a tiny model's log-probs of the responses are those of the unpadded batch."""
    from transformers import AutoModelForCausalLM

    from ember.engines.log_probs import compute_response_log_probs
    from ember.models.tiny import tiny_model_config

    batch = padded_batch()
    padded = pad_prompt_columns(batch, multiple)
    width = batch.input_ids.shape[1]
    assert padded.input_ids.shape[1] % multiple == 0 and padded.input_ids.shape[1] - width < multiple
    assert torch.equal(padded.responses, batch.responses) and torch.equal(padded.response_mask, batch.response_mask)
    assert padded.attention_mask.sum() == batch.attention_mask.sum()
    assert torch.equal(padded.rollout_log_probs, batch.rollout_log_probs)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen2", vocab_size=32)).eval()

    with torch.no_grad():
        expected, got = compute_response_log_probs(model, batch), compute_response_log_probs(model, padded)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(got[0][mask], expected[0][mask], atol=1e-5, rtol=0)


def test_the_interleaved_schedules_multiple_rounds_the_count_up_and_refuses_what_the_samples_cannot_fill():
    from ember.engines.batching import micro_batches
    from ember.errors import UserError

    def one_rank(tensor, op):
        return tensor

    batch = padded_batch()  # 3 samples of 3, 4 and 5 tokens
    micros, groups = micro_batches(batch, MicroBatchSpec(max_token_len=100), one_rank, count_multiple=2)
    assert len(micros) == 2 and sorted(i for group in groups for i in group) == [0, 1, 2]  # one would do
    assert len(micro_batches(batch, MicroBatchSpec(max_token_len=100), one_rank)[0]) == 1
    with pytest.raises(UserError, match="runs a multiple of 4 micro-batches .* a rank holds 3 samples"):
        micro_batches(batch, MicroBatchSpec(max_token_len=100), one_rank, count_multiple=4)
    assert len(micro_batches(batch, MicroBatchSpec(size=1), one_rank, count_multiple=3)[0]) == 3
    micros, groups = micro_batches(batch, MicroBatchSpec(size=2), one_rank, count_multiple=3)  # [2, 1] -> 3 of one
    assert groups == [[0], [1], [2]] and [len(micro) for micro in micros] == [1, 1, 1]
    assert torch.equal(micros[1].input_ids, batch.input_ids[1:2])  # the batch's width kept, as for a fixed size
    with pytest.raises(UserError, match="runs a multiple of 4 micro-batches .* a rank holds 3 samples"):
        micro_batches(batch, MicroBatchSpec(size=2), one_rank, count_multiple=4)
