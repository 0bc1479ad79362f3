"""KL penalty in the reward (`algorithm.use_kl_in_reward`) and the controllers of its coefficient.

`apply_kl_penalty` subtracts coef · KL(π_rollout ‖ π_ref) from every token's score before
advantages are computed, so the penalty is shaped by the estimator (discounted, whitened,
grouped) like any reward. The coefficient is fixed, or adapted towards a target KL by the
rule of Ziegler et al. 2019 (verl's `algorithm.kl_ctrl.type=adaptive`).
"""

from __future__ import annotations

import math

import torch

from ember.algorithms.kl import kl_penalty
from ember.algorithms.masked import masked_mean, zero_padding

ADAPTIVE_ERROR_LIMIT = 0.2  # the proportional error is clipped to ±this, as in Ziegler et al.


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are used the same way."""


class AdaptiveKLController:
    """Moves the coefficient so the observed KL approaches `target_kl`.

    error = clip(current_kl / target_kl - 1, ±0.2); value *= 1 + error · n_steps / horizon,
    where n_steps is the number of samples the KL was measured on.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be positive, got {target_kl}.")
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be positive, got {horizon}.")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):  # its step's update is skipped as unsound; the coefficient must stay a number
            return
        error = min(max(current_kl / self.target_kl - 1, -ADAPTIVE_ERROR_LIMIT), ADAPTIVE_ERROR_LIMIT)
        self.value *= 1 + error * n_steps / self.horizon


@torch.no_grad()
def apply_kl_penalty(
    *,
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """(token_level_rewards, metrics): scores - kl_coef · KL estimate on valid tokens; arguments by name.

    metrics["kl"] is the mean over sequences of each sequence's mean token KL (what the
    adaptive controller is updated with, with n_steps = batch size); metrics["kl_coef"] is
    the coefficient used.
    """
    token_kl = zero_padding(kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kind=kind), mask=response_mask)
    rewards = token_level_scores - kl_coef * token_kl
    mean_kl = masked_mean(token_kl, mask=response_mask, dim=-1).mean()
    return rewards, {"kl": float(mean_kl), "kl_coef": float(kl_coef)}
