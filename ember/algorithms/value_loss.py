"""The critic's clipped value loss (PPO, as in verl's `compute_value_loss`).

The new value prediction may move at most `cliprange_value` away from the value recorded at
rollout time before the clipped branch takes over; the loss is the larger of the clipped and
unclipped squared errors, times 0.5, aggregated like the policy loss.

The prediction itself is clamped to [old - c, old + c] (not rebuilt as old + clamp(new - old)):
inside the range the clipped prediction is then bit-for-bit the prediction, so `clipfrac`
counts only tokens that really left the range, as verl's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.algorithms.loss_aggregation import Count, aggregate_loss
from ember.algorithms.masked import masked_mean


@dataclass(frozen=True)
class ValueLossOutput:
    """The loss and its metric; the metric is a detached 0-dim tensor (call float() to log)."""

    loss: torch.Tensor  # scalar to back-propagate
    clipfrac: torch.Tensor  # fraction of valid tokens where the clipped error is the larger one


def compute_value_loss(
    *,
    predicted_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    norm_length: Count | None = None,
) -> ValueLossOutput:
    """0.5 · aggregate(max((V - R)², (clip(V) - R)²)), arguments by name only.

    predicted_values: [B, R] predictions of the critic being trained (carry the gradient);
        verl calls these `vpreds`.
    old_values: [B, R] predictions recorded when the batch was generated (verl's `values`).
    returns: [B, R] targets (from the advantage estimator).
    The aggregation arguments are those of `aggregate_loss`.
    """
    # verl's clip_by_value: min then max, so the gradient at the range's edges is the same too.
    clipped_values = torch.maximum(torch.minimum(predicted_values, old_values + cliprange_value),
                                   old_values - cliprange_value)
    unclipped_error = (predicted_values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    token_losses = torch.maximum(unclipped_error, clipped_error)
    loss = 0.5 * aggregate_loss(token_losses, mask=response_mask, mode=loss_agg_mode, num_tokens=num_tokens,
                                num_sequences=num_sequences, norm_length=norm_length)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).to(predicted_values.dtype), mask=response_mask)
    return ValueLossOutput(loss=loss, clipfrac=clipfrac)
