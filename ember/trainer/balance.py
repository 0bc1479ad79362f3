"""`trainer.balance_batch`: reorder a batch so that each data-parallel rank's contiguous share
carries about the same number of tokens.

A batch is split over `dp_size` ranks in equal contiguous chunks, and a step takes as long as
its slowest rank, so chunks should hold near-equal token counts (attention-mask sums: prompt +
response). The samples are partitioned into `dp_size` groups of equal size by the
Karmarkar–Karp largest differencing method, then laid out group after group; the batch is
`Batch.select(permutation)`, so every per-sample field (uids, lists) follows. With one rank
the permutation is the identity.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from ember.data.batch import Batch


@dataclass(frozen=True)
class BalancedBatch:
    """A batch reordered for its data-parallel ranks."""

    batch: Batch  # the input's `select(permutation)`, or the input itself when the order is unchanged
    permutation: list[int]  # sample i of `batch` is sample permutation[i] of the input
    metrics: dict[str, float]  # the largest chunk's tokens over the mean chunk's, before and after


def balance_batch(batch: Batch, dp_size: int) -> BalancedBatch:
    """`batch` reordered so its `dp_size` contiguous chunks of equal size have near-equal token counts."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    permutation = balanced_permutation(lengths, dp_size)
    reordered = batch if permutation == list(range(len(batch))) else batch.select(permutation)
    metrics = {"batch/balance_max_over_mean_before": chunk_imbalance(lengths, dp_size),
               "batch/balance_max_over_mean_after": chunk_imbalance([lengths[i] for i in permutation], dp_size)}
    return BalancedBatch(batch=reordered, permutation=permutation, metrics=metrics)


def balanced_permutation(lengths: Sequence[int], dp_size: int) -> list[int]:
    """An order of the samples whose `dp_size` contiguous chunks have equal sizes and near-equal
    length sums, never worse balanced than the original order (which is kept when it is at
    least as good, and always at one rank). Within a chunk samples keep their original order,
    and chunks are ordered by their first sample."""
    groups = equal_size_partition(lengths, dp_size)
    permutation = [index for group in sorted(groups, key=lambda group: group[:1]) for index in group]
    identity = list(range(len(lengths)))
    if chunk_imbalance(lengths, dp_size) <= chunk_imbalance([lengths[i] for i in permutation], dp_size):
        return identity
    return permutation


def equal_size_partition(lengths: Sequence[int], count: int) -> list[list[int]]:
    """`count` groups of `len(lengths) / count` sample indices each (ascending) with near-equal length sums.

    Karmarkar–Karp for equal sizes: the samples in order of length form runs of `count`, each
    run a partial solution of one sample per group. The two partial solutions whose group sums
    spread the most are merged, heaviest group of one with lightest of the other, until one is left.
    """
    if count < 1:
        raise ValueError(f"cannot balance a batch over {count} data-parallel ranks; use at least 1")
    if len(lengths) % count:
        raise ValueError(f"cannot split {len(lengths)} samples into {count} data-parallel chunks of equal size; "
                         "make the batch (train_batch_size × rollout.n) divisible by the data-parallel size, "
                         "or set trainer.balance_batch=False")
    if not lengths:
        return [[] for _ in range(count)]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    # Each entry: (-spread, tie-breaker, groups as (sum, indices) heaviest first); heapq pops the largest spread.
    partials = []
    for tie, start in enumerate(range(0, len(order), count)):
        groups = sorted(((lengths[i], [i]) for i in order[start:start + count]), key=lambda group: -group[0])
        partials.append((groups[-1][0] - groups[0][0], tie, groups))
    heapq.heapify(partials)
    tie = len(partials)
    while len(partials) > 1:
        _, _, first = heapq.heappop(partials)
        _, _, second = heapq.heappop(partials)
        merged = [(sum_a + sum_b, indices_a + indices_b)
                  for (sum_a, indices_a), (sum_b, indices_b) in zip(first, reversed(second))]
        merged.sort(key=lambda group: -group[0])
        heapq.heappush(partials, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    return [sorted(indices) for _, indices in partials[0][2]]


def chunk_imbalance(lengths: Sequence[int], dp_size: int) -> float:
    """The largest length sum of `dp_size` equal contiguous chunks over their mean (1.0 is perfect)."""
    share = len(lengths) // dp_size
    sums = [sum(lengths[rank * share:(rank + 1) * share]) for rank in range(dp_size)]
    mean = sum(sums) / dp_size
    return max(sums) / mean if mean > 0 else 1.0
