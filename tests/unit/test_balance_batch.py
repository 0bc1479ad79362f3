"""trainer.balance_batch: equal-size chunks per data-parallel rank with near-equal token counts,
a true permutation whose per-sample fields follow, and the identity on one rank."""

import random

import pytest
import torch

from ember.data.batch import Batch
from ember.trainer.balance import balance_batch, balanced_permutation, chunk_imbalance, equal_size_partition

EOS = 9


def skewed_batch(groups: int = 4, samples_per_group: int = 4) -> Batch:
    """GRPO-shaped: prompt p's samples share a uid and have long responses for late prompts, so the
    identity order puts the short samples on the first ranks and the long ones on the last."""
    prompts, responses, uids = [], [], []
    for prompt in range(groups):
        for sample in range(samples_per_group):
            prompts.append([1, 2, 3])
            responses.append([4] * (1 + 6 * prompt + sample) + [EOS])
            uids.append(f"p{prompt}")
    return Batch.from_rollout(prompts, responses, pad_token_id=0, eos_token_ids=[EOS], uids=uids,
                              rollout_log_probs=[[-0.01 * (i + 1)] * len(r) for i, r in enumerate(responses)],
                              data_sources=[f"source{i}" for i in range(len(prompts))])


def chunk_token_sums(batch: Batch, dp_size: int) -> list[int]:
    return [int(chunk.attention_mask.sum()) for chunk in batch.split(len(batch) // dp_size)]


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_chunks_have_equal_sizes_and_the_imbalance_falls(dp_size):
    batch = skewed_batch()
    balanced = balance_batch(batch, dp_size)
    chunks = balanced.batch.split(len(batch) // dp_size)
    assert [len(chunk) for chunk in chunks] == [len(batch) // dp_size] * dp_size
    before, after = chunk_token_sums(batch, dp_size), chunk_token_sums(balanced.batch, dp_size)
    assert max(after) - min(after) < (max(before) - min(before)) / 4
    metrics = balanced.metrics
    assert metrics["batch/balance_max_over_mean_before"] == pytest.approx(max(before) / (sum(before) / dp_size))
    assert metrics["batch/balance_max_over_mean_after"] == pytest.approx(max(after) / (sum(after) / dp_size))
    assert metrics["batch/balance_max_over_mean_after"] < metrics["batch/balance_max_over_mean_before"]


def test_the_order_is_a_permutation_that_every_field_follows():
    batch = skewed_batch()
    balanced = balance_batch(batch, 4)
    assert sorted(balanced.permutation) == list(range(len(batch)))
    assert balanced.permutation != list(range(len(batch)))
    for position, source_index in enumerate(balanced.permutation):
        assert torch.equal(balanced.batch.input_ids[position], batch.input_ids[source_index])
        assert torch.equal(balanced.batch.rollout_log_probs[position], batch.rollout_log_probs[source_index])
        assert balanced.batch.uids[position] == batch.uids[source_index]
        assert balanced.batch.data_sources[position] == batch.data_sources[source_index]


def test_one_rank_keeps_the_order_and_still_reports_the_metric():
    batch = skewed_batch()
    balanced = balance_batch(batch, 1)
    assert balanced.permutation == list(range(len(batch)))
    assert balanced.batch is batch
    assert balanced.metrics == {"batch/balance_max_over_mean_before": 1.0, "batch/balance_max_over_mean_after": 1.0}


def test_partition_is_near_optimal_on_random_lengths():
    rng = random.Random(0)
    for trial in range(50):
        count = rng.choice([2, 3, 4, 8])
        lengths = [rng.randint(1, 1000) for _ in range(count * rng.randint(1, 16))]
        groups = equal_size_partition(lengths, count)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        assert {len(group) for group in groups} == {len(lengths) // count}
        sums = [sum(lengths[i] for i in group) for group in groups]
        # Karmarkar–Karp leaves at most about one sample's length between the heaviest and lightest group.
        assert max(sums) - min(sums) <= max(lengths), (trial, sums)
        # The permutation lays the groups out as the contiguous chunks.
        permuted = [lengths[i] for i in balanced_permutation(lengths, count)]
        assert chunk_imbalance(permuted, count) == pytest.approx(max(sums) / (sum(sums) / count))


def test_karmarkar_karp_finds_the_perfect_split_where_the_variants_do_not():
    """Both groups of this batch can hold 69 tokens; the largest differencing method (merge the two partial
    solutions that spread the most, heaviest group of one with the lightest of the other) finds it."""
    lengths = [15, 19, 30, 22, 1, 9, 12, 15, 3, 12]
    groups = equal_size_partition(lengths, 2)
    assert [sum(lengths[i] for i in group) for group in groups] == [69, 69]
    assert [len(group) for group in groups] == [5, 5]


def test_a_batch_that_does_not_divide_is_refused_with_the_keys_to_change():
    with pytest.raises(ValueError, match=r"cannot split 6 samples into 4 data-parallel chunks of equal size; make the "
                                         r"batch \(train_batch_size × rollout.n\) divisible by the data-parallel size, "
                                         r"or set trainer.balance_batch=False"):
        balanced_permutation([1] * 6, 4)
    with pytest.raises(ValueError, match="cannot balance a batch over 0 data-parallel ranks; use at least 1"):
        equal_size_partition([1, 2], 0)
    assert equal_size_partition([], 2) == [[], []]


def test_an_already_balanced_order_is_kept():
    lengths = [1, 1, 5, 2, 3, 2]  # chunks 1+1+5 and 2+3+2: equal already
    assert balanced_permutation(lengths, 2) == list(range(6))
    assert balanced_permutation([5, 4, 4, 5], 2) == [0, 1, 2, 3]  # not [0, 2, 1, 3], which is only as good
