"""Forming micro-batches by a token budget (verl's "dynamic batch size"), and trimming padding.

A fixed number of samples per micro-batch wastes compute when response lengths vary: a
micro-batch of short responses costs as much as one of long ones. With a token budget the
samples are partitioned into the fewest micro-batches whose token counts (prompt + response
tokens, the attention-mask sums) stay within it, balanced so that each micro-batch carries
about the same number of tokens. The partition is the greedy longest-processing-time one:
samples in decreasing length, each into the micro-batch that holds the fewest tokens so far.

Every data-parallel rank must run the same number of micro-batches (each forward and backward
is a collective), so the engine takes the largest `min_micro_batch_count` over the ranks and
asks every rank for a plan with that count. `trim_columns` then cuts each micro-batch down to
the columns its own samples use, so a micro-batch of short sequences really is cheaper.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ember.data.batch import RESPONSE, SEQUENCE, Batch


def balanced_partition(lengths: Sequence[int], count: int) -> list[list[int]]:
    """`count` groups of sample indices with near-equal length sums (longest processing time first).

    Each group's indices are ascending, and groups are ordered by their first index. A group
    is empty only when there are fewer samples than groups.
    """
    if count < 1:
        raise ValueError(f"cannot partition samples into {count} micro-batches; ask for at least 1")
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [(0, group) for group in range(count)]  # (tokens so far, group): a min-heap
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, group = heapq.heappop(loads)
        groups[group].append(index)
        heapq.heappush(loads, (load + lengths[index], group))
    return sorted((sorted(group) for group in groups), key=lambda group: group[0] if group else math.inf)


def fits_budget(lengths: Sequence[int], groups: list[list[int]], max_token_len: int) -> bool:
    """Whether each group stays within `max_token_len` tokens or holds a single (over-long) sample."""
    return all(len(group) <= 1 or sum(lengths[i] for i in group) <= max_token_len for group in groups)


def min_micro_batch_count(lengths: Sequence[int], max_token_len: int) -> int:
    """The fewest micro-batches whose balanced partition respects the budget.

    Starts at the lower bound (one micro-batch per over-long sample plus the remaining tokens
    divided by the budget) and adds micro-batches until the balanced partition fits; with one
    sample per micro-batch it always does. An empty batch needs none.
    """
    if max_token_len < 1:
        raise ValueError(f"a token budget of {max_token_len} per micro-batch cannot hold a token; use at least 1")
    over_long = sum(1 for length in lengths if length > max_token_len)
    remaining = sum(length for length in lengths if length <= max_token_len)
    count = over_long + math.ceil(remaining / max_token_len)
    while count < len(lengths) and not fits_budget(lengths, balanced_partition(lengths, count), max_token_len):
        count += 1
    return min(count, len(lengths))


def plan_micro_batches(lengths: Sequence[int], max_token_len: int,
                       num_micro_batches: int | None = None) -> list[list[int]]:
    """Sample indices of each micro-batch: every index exactly once, token sums near-equal.

    `lengths` are the tokens each sample occupies (attention-mask sums). Each micro-batch holds
    at most `max_token_len` tokens, except that a sample longer than the budget gets a
    micro-batch of its own. `num_micro_batches` (at least `min_micro_batch_count`, at most the
    number of samples) fixes the count, so that all data-parallel ranks run the same number;
    by default it is this batch's minimum.
    """
    needed = min_micro_batch_count(lengths, max_token_len)
    count = needed if num_micro_batches is None else num_micro_batches
    if not needed <= count <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} samples into {count} micro-batches of at most {max_token_len} "
                         f"tokens: between {needed} and {len(lengths)} are possible")
    groups = balanced_partition(lengths, count)
    if not fits_budget(lengths, groups, max_token_len):
        raise ValueError(f"{count} balanced micro-batches exceed the budget of {max_token_len} tokens although "
                         f"{needed} fit; raise the token budget (ppo_max_token_len_per_gpu or its log-prob twin)")
    return groups


def used_extents(batch: Batch) -> tuple[list[int], list[int]]:
    """Per sample: the first prompt column it uses and how many response columns it uses.

    One host transfer for the whole batch, so trimming its micro-batches costs no device sync.
    A sample always keeps the last prompt column (it predicts the first response token).
    """
    prompt_used = batch.attention_mask[:, :batch.prompt_length].bool()
    first_prompt_column = prompt_used.int().argmax(dim=1).masked_fill(~prompt_used.any(dim=1), batch.prompt_length - 1)
    response_used = batch.attention_mask[:, batch.prompt_length:].bool() | batch.response_mask.bool()
    columns = response_used.shape[1] - response_used.flip(dims=[1]).int().argmax(dim=1)
    response_columns = columns.masked_fill(~response_used.any(dim=1), 0)
    return first_prompt_column.tolist(), response_columns.tolist()


def trim_columns(batch: Batch, prompt_start: int, response_length: int) -> Batch:
    """`batch` without its first `prompt_start` prompt columns and with `response_length` response columns.

    Callers pass bounds from `used_extents` so that only all-padding columns go. At least one
    response column is kept. Positions are counted over real tokens, so outputs do not change.
    """
    prompt_start = min(prompt_start, batch.prompt_length - 1)
    response_length = max(min(response_length, batch.response_length), 1)
    if prompt_start == 0 and response_length == batch.response_length:
        return batch
    end = batch.prompt_length + response_length
    updates: dict[str, Tensor] = {}
    for item in dataclasses.fields(batch):
        value = getattr(batch, item.name)
        if not isinstance(value, Tensor):
            continue
        if item.metadata["layout"] == SEQUENCE:
            updates[item.name] = value[:, prompt_start:end]
        elif item.metadata["layout"] == RESPONSE:
            updates[item.name] = value[:, :response_length]
    return batch.with_fields(**updates)


def pad_prompt_columns(batch: Batch, multiple: int) -> Batch:
    """`batch` with padding columns added before its (left-padded) prompts, so that its width is a
    multiple of `multiple` (sequence parallelism splits the sequence evenly over tensor-parallel ranks).
    Padding has attention mask 0, token 0 and position 0, as left padding has: outputs do not change."""
    extra = -batch.input_ids.shape[1] % multiple
    if extra == 0:
        return batch
    updates: dict[str, Tensor] = {}
    for item in dataclasses.fields(batch):
        value = getattr(batch, item.name)
        if isinstance(value, Tensor) and item.metadata["layout"] == SEQUENCE:
            updates[item.name] = torch.cat([value.new_zeros((value.shape[0], extra, *value.shape[2:])), value], dim=1)
    return batch.with_fields(**updates)
