"""Advantage estimators that walk the response token by token: GAE, REINFORCE++ and ReMax.

All estimators share one input record, `AdvantageInputs` (built by field name: rewards, mask
and values have the same shape), and one output: `(advantages, returns)`, both
[batch, response_length] and 0 on padding. Each is registered by the name a
verl user writes in `algorithm.adv_estimator`; `get_advantage_fn(name)(inputs)` runs one.
The group-baseline estimators (grpo, rloo, reinforce_plus_plus_baseline) live in
`group_advantages.py`.

Masked steps are skipped, not treated as the end of the episode: they add no reward, are not
discounted, and the recursion carries across them. With padding only after EOS this is
exactly verl's behaviour; for masks with holes (e.g. tool-output tokens in multi-turn
responses) the next valid token's value/return bridges the hole. verl's GAE bridges holes so
too, but its REINFORCE++ resets the running return at every masked token
(`running_return * response_mask[:, t]`, written for padding after EOS), so there the outcome
reward never reaches the turns before a tool's output; ember's REINFORCE++ carries it across,
as its GAE does (a deliberate departure, which only multi-turn masks with holes see).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ember.algorithms.masked import masked_whiten, zero_padding
from ember.algorithms.registry import register_advantage


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """Everything any registered estimator may read; each uses the fields it needs."""

    token_level_rewards: torch.Tensor  # [B, R] reward of each response token (outcome rewards sit on the last one)
    response_mask: torch.Tensor  # [B, R] 1 for tokens that count, 0 for padding
    group_ids: Sequence | torch.Tensor | None = None  # [B] id of each sample's prompt group (grpo, rloo, ...)
    values: torch.Tensor | None = None  # [B, R] critic values of the rollout policy (gae)
    reward_baselines: torch.Tensor | None = None  # [B] reward of the greedy response to the same prompt (remax)
    gamma: float = 1.0  # discount factor per token
    lam: float = 1.0  # GAE lambda: 1 is Monte-Carlo returns, 0 is one-step TD
    norm_adv_by_std_in_grpo: bool = True  # grpo: divide by the group std (False gives Dr. GRPO)
    epsilon: float = 1e-6  # added to the group std before dividing


def discounted_returns(*, rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_next over valid tokens; masked steps are skipped."""
    valid = mask.bool()
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return zero_padding(returns, mask=mask)


@register_advantage("gae")
@torch.no_grad()
def compute_gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) with a critic.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next"
    is the next valid token. Returns are A + V before whitening (the critic's target); the
    advantages are then whitened over the valid tokens of the batch.
    """
    if inputs.values is None:
        raise ValueError("The gae estimator needs critic values; enable the critic or pick grpo/rloo/remax.")
    rewards, values, valid = inputs.token_level_rewards, inputs.values, inputs.response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    running_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        candidate = delta + inputs.gamma * inputs.lam * running_advantage
        running_advantage = torch.where(valid[:, t], candidate, running_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running_advantage
    advantages = zero_padding(advantages, mask=inputs.response_mask)
    returns = zero_padding(advantages + values, mask=inputs.response_mask)
    return masked_whiten(advantages, mask=inputs.response_mask), returns


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's valid tokens."""
    returns = discounted_returns(rewards=inputs.token_level_rewards, mask=inputs.response_mask, gamma=inputs.gamma)
    return masked_whiten(returns, mask=inputs.response_mask), returns


@register_advantage("remax")
@torch.no_grad()
def compute_remax_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): undiscounted return-to-go minus the greedy response's reward.

    As in verl, gamma is not applied and nothing is whitened.
    """
    if inputs.reward_baselines is None:
        raise ValueError(
            "The remax estimator needs reward_baselines (the reward of a greedy response per prompt); "
            "generate them in the trainer or pick another estimator."
        )
    returns = discounted_returns(rewards=inputs.token_level_rewards, mask=inputs.response_mask, gamma=1.0)
    advantages = zero_padding(returns - inputs.reward_baselines.to(returns.dtype).unsqueeze(-1),
                              mask=inputs.response_mask)
    return advantages, returns
