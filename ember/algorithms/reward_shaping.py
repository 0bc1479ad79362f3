"""DAPO's reward shaping and group filter (Yu et al., 2025, "DAPO"), as pure functions.

- Overlong shaping: a response of length L, with the last `buffer` tokens before the limit
  `max_length` as the soft zone, gets min(0, −(L − (max_length − buffer)) / buffer × factor):
  nothing up to max_length − buffer, then a linear penalty reaching −factor at max_length.
- Dynamic sampling keeps a prompt's group only when its samples' metric varies (a group
  that is all right or all wrong has zero advantage under GRPO, so it teaches nothing); a
  group of one sample is kept.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_length: int, buffer: int, factor: float) -> Tensor:
    """[B] penalty (≤ 0) of each response length, float32."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer {buffer}: give a length in 1..{max_length} (the response limit)")
    exceeding = response_lengths.float() - (max_length - buffer)
    return torch.clamp(-exceeding / buffer * factor, max=0.0)


def groups_with_spread(group_ids: Sequence[str], metric: Sequence[float]) -> list[str]:
    """The group ids, in first-seen order, whose samples' `metric` values are not all equal (or that
    hold one sample)."""
    values: dict[str, list[float]] = defaultdict(list)
    for group, value in zip(group_ids, metric):
        values[group].append(float(value))
    return [group for group, seen in values.items() if len(seen) == 1 or max(seen) > min(seen)]
