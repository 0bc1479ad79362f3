"""Per-token estimators of KL(π ‖ π_ref) from the log-probs of the sampled tokens.

Names as in verl's `kl_penalty` / `kl_loss_type` (Schulman, "Approximating KL divergence"):

- `kl` / `k1`: log π - log π_ref. Unbiased, high variance, can be negative.
- `abs`: |log π - log π_ref|.
- `mse` / `k2`: ½ (log π - log π_ref)². Its gradient is the gradient of the true KL.
- `low_var_kl` / `k3`: π_ref/π - log(π_ref/π) - 1. Unbiased, low variance, never negative;
  clamped to at most 10 as verl (the log-ratio is clamped to ±20 before exp).
- `full`: the exact KL over the whole vocabulary; takes [B, R, V] logits or log-probs of
  both models instead of the sampled tokens' log-probs.

Appending `+` (e.g. `k3+`, `low_var_kl+`) gives a straight-through variant: the value of the
named estimator with the gradient of k2, since k1 and k3 estimate the KL's value but their
gradients are not the KL's gradient.

Every estimator takes `log_probs` (the policy being trained) and `ref_log_probs` by name: the
KL is not symmetric, and swapped tensors of the same shape would give a wrong value silently.
"""

from __future__ import annotations

from typing import Callable

import torch

LOG_RATIO_LIMIT = 20.0  # |log π_ref - log π| is clamped to this before exp in k3
LOW_VAR_KL_MAX = 10.0  # k3 values above this are clamped, as verl


def k1_estimate(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def absolute_estimate(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


def k2_estimate(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


def k3_estimate(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """exp(x) - x - 1 with x = log π_ref - log π, via expm1 so that it stays >= 0 near x = 0.

    The lower clamp at 0 only removes rounding error (the exact value is never negative).
    """
    log_ratio = torch.clamp(ref_log_probs - log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.clamp(torch.expm1(log_ratio) - log_ratio, min=0.0, max=LOW_VAR_KL_MAX)


def full_kl(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Σ_v p_v (log p_v - log q_v) over the last dimension, in float32: [B, R, V] → [B, R].

    Takes log-probs or logits of the whole vocabulary (log_softmax of log-probs is the identity).
    """
    log_p = torch.log_softmax(log_probs.float(), dim=-1)
    log_q = torch.log_softmax(ref_log_probs.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


KL_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {  # called as fn(log_probs=..., ref_log_probs=...)
    "kl": k1_estimate,
    "k1": k1_estimate,
    "abs": absolute_estimate,
    "mse": k2_estimate,
    "k2": k2_estimate,
    "low_var_kl": k3_estimate,
    "k3": k3_estimate,
    "full": full_kl,
}
STRAIGHT_THROUGH_SUFFIX = "+"


def kl_estimator_names() -> list[str]:
    """Every accepted `kind`, including the straight-through `+` variants."""
    base = [name for name in KL_ESTIMATORS if name != "full"]
    return sorted(KL_ESTIMATORS) + sorted(name + STRAIGHT_THROUGH_SUFFIX for name in base)


def kl_penalty(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the named `kind` (see the module docstring); same shape as the inputs
    ([B, R]), or [B, R] from [B, R, V] for `full`. Padding is not masked here: aggregate with the mask.
    """
    if kind not in kl_estimator_names():
        raise ValueError(f"Unknown KL estimator {kind!r}; valid names: {', '.join(kl_estimator_names())}.")
    if not kind.endswith(STRAIGHT_THROUGH_SUFFIX):
        return KL_ESTIMATORS[kind](log_probs=log_probs, ref_log_probs=ref_log_probs)
    value = KL_ESTIMATORS[kind.removesuffix(STRAIGHT_THROUGH_SUFFIX)](log_probs=log_probs, ref_log_probs=ref_log_probs)
    gradient_carrier = k2_estimate(log_probs=log_probs, ref_log_probs=ref_log_probs)
    return gradient_carrier - gradient_carrier.detach() + value.detach()
