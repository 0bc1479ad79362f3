"""Advantage estimators with a baseline from the other responses to the same prompt.

GRPO, RLOO and REINFORCE++-baseline score each response by the sum of its token rewards
(over valid tokens only; verl sums over padding too, which only differs if padding holds
rewards), compare it with the other samples of its prompt group (`AdvantageInputs.group_ids`,
one id per sample, e.g. the prompt uid repeated `rollout.n` times), and broadcast the
per-sequence advantage over the response's valid tokens. Advantages and returns are equal.

A group of one sample has no peers: following verl, its mean is taken as 0 and its std as 1,
so the advantage is the raw score. Group std is the unbiased estimator (n - 1), as torch.std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ember.algorithms.advantages import AdvantageInputs
from ember.algorithms.masked import masked_whiten, zero_padding
from ember.algorithms.registry import register_advantage


def group_index(group_ids: Sequence | torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map each sample's group id (any hashable, or an int tensor) to a dense index 0..G-1."""
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries but the batch has {batch_size} samples.")
    if isinstance(group_ids, torch.Tensor):
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    dense: dict = {}
    index = [dense.setdefault(group_id, len(dense)) for group_id in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


@dataclass(frozen=True, kw_only=True)
class GroupStatistics:
    """Per-sample statistics of the sample's group, each [B]."""

    size: torch.Tensor  # number of samples in the group
    mean: torch.Tensor  # mean score of the group (0 for a group of one)
    std: torch.Tensor  # unbiased std of the group's scores (1 for a group of one)


def group_statistics(scores: torch.Tensor, index: torch.Tensor) -> GroupStatistics:
    """Group size, mean and unbiased std of `scores` [B], gathered back to each sample."""
    num_groups = int(index.max()) + 1
    size = torch.bincount(index, minlength=num_groups).to(scores.dtype)
    mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores) / size
    squared = (scores - mean[index]) ** 2
    sum_squared = torch.zeros_like(mean).index_add_(0, index, squared)
    single = size < 2
    std = torch.where(single, torch.ones_like(mean), (sum_squared / (size - 1).clamp(min=1)).sqrt())
    mean = torch.where(single, torch.zeros_like(mean), mean)
    return GroupStatistics(size=size[index], mean=mean[index], std=std[index])


def sequence_scores_and_groups(inputs: AdvantageInputs, estimator: str) -> tuple[torch.Tensor, GroupStatistics]:
    """Per-sequence score (the sum of its token rewards, which are 0 past the response) and its group's statistics.
    The sum is not masked, as verl's is not: rollout correction's rejection masks tokens before the advantages,
    and a sequence whose rewarded last token it rejected still scores that reward for its group."""
    if inputs.group_ids is None:
        raise ValueError(f"The {estimator} estimator needs group_ids (the prompt uid of every sample).")
    scores = inputs.token_level_rewards.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    return scores, group_statistics(scores, index)


def broadcast_over_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] → [B, R]: the sequence's value on each of its valid tokens, 0 on padding."""
    return zero_padding(per_sequence.unsqueeze(-1).expand(mask.shape), mask=mask)


@register_advantage("grpo")
@torch.no_grad()
def compute_grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + epsilon).

    With `norm_adv_by_std_in_grpo=False` the std division is dropped (Dr. GRPO).
    """
    scores, group = sequence_scores_and_groups(inputs, "grpo")
    advantages = scores - group.mean
    if inputs.norm_adv_by_std_in_grpo:
        advantages = advantages / (group.std + inputs.epsilon)
    advantages = broadcast_over_tokens(advantages, inputs.response_mask)
    return advantages, advantages


@register_advantage("rloo")
@torch.no_grad()
def compute_rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the *other* samples.

    Written as verl does, (score - group mean) * n / (n - 1), which equals it.
    """
    scores, group = sequence_scores_and_groups(inputs, "rloo")
    leave_one_out = (scores - group.mean) * group.size / (group.size - 1).clamp(min=1)
    advantages = torch.where(group.size > 1, leave_one_out, scores)
    advantages = broadcast_over_tokens(advantages, inputs.response_mask)
    return advantages, advantages


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): score minus group mean, whitened over the batch's valid tokens."""
    scores, group = sequence_scores_and_groups(inputs, "reinforce_plus_plus_baseline")
    advantages = masked_whiten(broadcast_over_tokens(scores - group.mean, inputs.response_mask),
                               mask=inputs.response_mask)
    return advantages, advantages
