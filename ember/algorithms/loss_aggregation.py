"""Reduce a [batch, response_length] loss matrix to the scalar that is back-propagated.

Five modes, named as in verl's `loss_agg_mode`:

- `token-mean`: every valid token weighs the same (long responses weigh more in total).
- `token-sum`: the sum over every valid token of the mini-batch, not normalised at all, so
  the loss (and the gradient) grows with the number of tokens (verl 0.9's `token-sum`).
- `seq-mean-token-sum`: sum over each sequence's tokens, mean over sequences.
- `seq-mean-token-mean`: mean over each sequence's tokens, mean over sequences.
- `seq-mean-token-sum-norm`: sum over each sequence's tokens divided by a constant
  `norm_length` (Dr. GRPO's generation budget; verl's `actor.loss_scale_factor`, which
  the actor passes here, else the padded response length),
  mean over sequences (Dr. GRPO's 1 / (N · L)). verl does not take the mean over
  sequences here (a change that did, in December 2025, was reverted): its `agg_loss`
  returns sum / L per micro-batch, which its legacy actor then scales by 1 / (micro-batches)
  and FSDP averages over ranks, so verl's loss and gradient are ember's times
  (sequences in the mini-batch) / (micro-batches × ranks), the micro-batch size. A constant
  factor, which Adam mostly absorbs but gradient clipping and the logged loss do not.

Micro-batches and data parallelism: a mini-batch is often split across gradient
accumulation steps and ranks. Pass the mini-batch's global counts (`num_tokens`, the valid
tokens; `num_sequences`, the sequences with at least one valid token; both summed over all
micro-batches and ranks, see `count_tokens_and_sequences`) and the function returns this
micro-batch's *share*: its sum divided by the global count. The shares of all micro-batches
and ranks add up to the loss of the whole mini-batch, so summing their gradients is exact
even when micro-batches hold different numbers of tokens. If the data-parallel gradient
reduction averages over ranks (FSDP does), multiply the share by the world size to keep the
sum. Without global counts the micro-batch is normalised on its own. `token-sum` needs no
counts: a micro-batch's share is its own sum, with or without them.
"""

from __future__ import annotations

import torch

from ember.algorithms.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def count_tokens_and_sequences(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid tokens and sequences with at least one valid token, as the global counts expect.

    Sum these over the micro-batches (and all-reduce over ranks) of a mini-batch to get the
    `num_tokens` / `num_sequences` that `aggregate_loss` takes.
    """
    valid = response_mask.bool()
    return valid.sum(), valid.any(dim=-1).sum()


def aggregate_loss(
    loss_matrix: torch.Tensor,
    *,
    mask: torch.Tensor,
    mode: str,
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    norm_length: Count | None = None,
) -> torch.Tensor:
    """Scalar loss (or this micro-batch's share of it when global counts are given).

    Everything after `loss_matrix` is passed by name (the mask has its shape, the two counts
    are both integers).

    `norm_length` (seq-mean-token-sum-norm only) defaults to the padded width of `mask`; pass
    the configured maximum response length when micro-batches are padded to different widths.
    A count of 0 (nothing valid anywhere) gives a loss of 0 rather than nan.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}.")
    local_tokens, local_sequences = count_tokens_and_sequences(mask)
    if mode == "token-mean":
        return masked_sum(loss_matrix, mask=mask) / _denominator(num_tokens, local_tokens, loss_matrix)
    if mode == "token-sum":
        return masked_sum(loss_matrix, mask=mask)
    sequence_sums = masked_sum(loss_matrix, mask=mask, dim=-1)
    if mode == "seq-mean-token-sum":
        sequence_losses = sequence_sums
    elif mode == "seq-mean-token-mean":
        sequence_losses = sequence_sums / mask.bool().sum(dim=-1).clamp(min=1).to(loss_matrix.dtype)
    else:
        sequence_losses = sequence_sums / (mask.shape[-1] if norm_length is None else norm_length)
    return sequence_losses.sum() / _denominator(num_sequences, local_sequences, loss_matrix)


def _denominator(global_count: Count | None, local_count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The global count when given, else the local one; clamped to 1 so empty batches give 0."""
    count = local_count if global_count is None else global_count
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
