"""Reductions over the valid tokens of a [batch, response_length] tensor.

Every algorithm in this package works on padded responses with a `response_mask` (1 for
tokens that count, 0 for padding). Masked positions are excluded with `torch.where`, not by
multiplying, so whatever sits under the padding (even inf or nan, e.g. log-probs of pad
tokens) never reaches a result or a gradient. The mask is passed by name (`mask=`): values
and mask have the same shape, so a swap by position would go unnoticed.
"""

from __future__ import annotations

import torch


def zero_padding(values: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
    """`values` with every masked position set to 0."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, *, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set, over `dim` (all elements when None)."""
    kept = zero_padding(values, mask=mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, *, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the valid positions; 0 where there are none (never nan)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask=mask, dim=dim) / count.clamp(min=1).to(values.dtype)


def masked_whiten(values: torch.Tensor, *, mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """Shift to zero mean and scale to unit variance over the valid tokens of the whole batch.

    The variance is the unbiased one (divided by n - 1), as verl's `masked_whiten`; masked
    positions of the result are 0. At least two valid tokens are required.
    """
    num_valid = int(mask.bool().sum())
    if num_valid < 2:
        raise ValueError(
            f"Whitening advantages needs at least 2 valid response tokens in the batch, got {num_valid}; "
            "use a larger batch or an estimator without whitening (grpo, rloo, remax)."
        )
    mean = masked_mean(values, mask=mask)
    variance = masked_sum((values - mean) ** 2, mask=mask) / (num_valid - 1)
    whitened = (values - mean) * torch.rsqrt(variance + epsilon)
    return zero_padding(whitened, mask=mask)
