"""Rollout correction: the training–inference mismatch, measured and corrected (verl's
`rollout_corr_helper`, same modes, thresholds and metric names).

The engine samples with its own numerics (π_rollout); the trainer scores the same tokens
with its own (π_train, the old log-probs). Everything here is a function of
log_ratio = log π_train − log π_rollout over the valid tokens:

- importance-sampling weights (`rollout_is`): "token" exp(log_ratio) per token, or
  "sequence" exp(Σ log_ratio) broadcast over the sequence; truncated at
  `rollout_is_threshold` (TIS), detached, optionally normalised to mean 1 over the batch;
- rejection masks (`rollout_rs`, options that must all pass, parsed by
  `ember/config/rollout_correction.py`): a divergence per token (token_k1/k2/k3) or per
  sequence (its sum, mean or max) against its bounds; k1 (the log-ratio) against a ratio
  range, k2/k3 against an upper bound. seq_max_k2/k3 reject a sequence for its single worst
  token: verl's replacement for its old per-token veto;
- metrics of the mismatch (KL, k3 KL, perplexities, χ²) that a run logs always.

In decoupled mode π_train is π_old (the trainer's forward before the update); in bypass mode
(`BypassCorrection`) the rollout's log-probs are π_old and π_train is the policy being trained,
measured inside the actor's loss on each micro-batch, as verl's `compute_policy_loss_bypass_mode`.

The one thing to know: log-ratios are clamped to ±20 before exp (verl's SAFETY_BOUND), so a
catastrophic token gives a weight of e^20 before truncation, never inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ember.algorithms.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
TOKEN_LEVEL_PREFIX = "token_"

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]
"""A tensor summed over the data-parallel ranks (an all-reduce the engine provides: `LossContext.sum_over_ranks`)."""


def _masked_max(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    filled = values.masked_fill(~mask.bool(), float("-inf"))
    return filled.max() if dim is None else filled.max(dim=dim).values


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask.bool(), float("inf")).min()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """verl's std of the statistic clamped to its thresholds (E[x²] − E[x]², floored at 0)."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    variance = masked_mean(clamped.square(), mask=mask) - masked_mean(clamped, mask=mask).square()
    return variance.clamp(min=0.0).sqrt().item()


def compute_rollout_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str,
                               threshold: float, batch_normalize: bool = False,
                               sum_over_ranks: SumOverRanks | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights π_train/π_rollout per token ([B, R], 0 on padding) and their metrics
    (`rollout_is_*`, measured before truncation). `batch_normalize` divides them by their mean over
    this batch, or with `sum_over_ranks` (a sum over the data-parallel ranks, each holding its own
    micro-batch: bypass mode) over every rank's, as verl's `distributed_masked_mean` does."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: use token or sequence")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold={threshold} must be positive")
    mask = response_mask.to(log_ratio.dtype)
    if level == "token":
        log_ratio_for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, mask=response_mask, dim=-1).unsqueeze(-1)
        weights = torch.exp(log_ratio_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * mask
    metrics = _is_metrics(weights, log_ratio_for_metrics, response_mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            totals = torch.stack([(weights * response_mask).sum(), response_mask.sum().to(weights.dtype)])
        else:
            has_tokens = response_mask.bool().any(dim=-1).to(weights.dtype)
            totals = torch.stack([(masked_mean(weights, mask=response_mask, dim=-1) * has_tokens).sum(),
                                  has_tokens.sum()])
        if sum_over_ranks is not None:  # the mean over every data-parallel rank's micro-batch, as verl's
            totals = sum_over_ranks(totals.detach()).to(weights.device)
        mean = totals[0] / totals[1].clamp(min=1)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(weights: torch.Tensor, log_ratio_for_metrics: torch.Tensor, mask: torch.Tensor, level: str,
                threshold: float) -> dict[str, float]:
    lower = 1.0 / threshold
    metrics: dict[str, float] = {"rollout_is_mean": masked_mean(weights, mask=mask).item()}
    if level == "sequence":
        metrics["rollout_is_max"] = math.exp(min(log_ratio_for_metrics.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(log_ratio_for_metrics.min().item())
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > math.log(threshold)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < math.log(lower)).float().mean().item()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), mask=mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((weights < lower).float(), mask=mask).item()
        metrics["rollout_is_max"] = _masked_max(weights, mask).item()
        metrics["rollout_is_min"] = _masked_min(weights, mask).item()
    metrics["rollout_is_std"] = _clamped_std(weights, mask, lower, threshold)
    for_ess = weights.clamp(min=lower, max=threshold)
    normalized = for_ess / (masked_mean(for_ess, mask=mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), mask=mask).item()
    per_sequence = masked_mean(weights, mask=mask, dim=-1)
    metrics["rollout_is_seq_mean"] = per_sequence.mean().item()
    metrics["rollout_is_seq_std"] = per_sequence.std().item() if per_sequence.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = per_sequence.max().item()
    metrics["rollout_is_seq_min"] = per_sequence.min().item()
    metrics["rollout_is_seq_max_deviation"] = (per_sequence - 1.0).abs().max().item()
    metrics["rollout_is_seq_fraction_high"] = (per_sequence > threshold).float().mean().item()
    metrics["rollout_is_seq_fraction_low"] = (per_sequence < lower).float().mean().item()
    return metrics


def compute_rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                   bounds: Mapping[str, tuple[float | None, float]]
                                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """`response_mask` with the tokens (or whole sequences) that fail any option set to 0, and
    the `rollout_rs_*` metrics. `bounds`: option → (lower, upper) as `config.rollout_correction.
    parse_rejection` reads verl's keys (lower: a k1 option's ratio bound, else None)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergences = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    valid = response_mask.bool()
    has_tokens = valid.any(dim=-1)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for option, (lower_bound, upper_bound) in bounds.items():
        divergence = divergences[option[-2:]]
        is_k1 = option.endswith("k1")
        upper = math.log(upper_bound) if is_k1 else upper_bound
        lower = math.log(lower_bound) if is_k1 else 0.0
        if option.startswith(TOKEN_LEVEL_PREFIX):
            statistic, per_sequence = divergence, None
        else:
            reduce = option.split("_")[1]
            if reduce == "sum":
                per_sequence = masked_sum(divergence, mask=response_mask, dim=-1)
            elif reduce == "mean":
                per_sequence = masked_mean(divergence, mask=response_mask, dim=-1)
            else:
                per_sequence = _masked_max(divergence, response_mask, dim=-1)
                per_sequence = torch.where(torch.isinf(per_sequence), torch.zeros_like(per_sequence), per_sequence)
            statistic = per_sequence.unsqueeze(-1).expand_as(divergence)
        option_keep = statistic <= upper
        if is_k1:
            option_keep = option_keep & (statistic >= lower)
        keep = keep & option_keep
        metrics.update(_rejection_metrics(option, statistic, per_sequence, response_mask, has_tokens,
                                          upper=upper, lower=lower, has_lower=is_k1))
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean((~option_keep).float(), mask=response_mask).item()
        rejected_sequence = ((~option_keep) & valid).any(dim=-1)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (rejected_sequence & has_tokens).float().sum() / has_tokens.float().sum()).item() if has_tokens.any() else 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).float(), mask=response_mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = ((~keep) & valid).any(dim=-1).float().mean().item()
    return (response_mask * keep.to(response_mask.dtype)).to(response_mask.dtype), metrics


def _rejection_metrics(option: str, statistic: torch.Tensor, per_sequence: torch.Tensor | None,
                       mask: torch.Tensor, has_tokens: torch.Tensor, *, upper: float, lower: float,
                       has_lower: bool) -> dict[str, float]:
    prefix = f"rollout_rs_{option}"
    if per_sequence is None:
        per_sequence = masked_mean(statistic, mask=mask, dim=-1)
    sequences = per_sequence[has_tokens]
    metrics = {f"{prefix}_mean": masked_mean(statistic, mask=mask).item()}
    if not option.startswith(TOKEN_LEVEL_PREFIX) and sequences.numel():
        metrics[f"{prefix}_max"] = sequences.max().item()
        metrics[f"{prefix}_min"] = sequences.min().item()
        metrics[f"{prefix}_fraction_high"] = (sequences > upper).float().mean().item()
        metrics[f"{prefix}_fraction_low"] = (sequences < lower).float().mean().item() if has_lower else 0.0
    else:
        metrics[f"{prefix}_max"] = _masked_max(statistic, mask).item()
        metrics[f"{prefix}_min"] = _masked_min(statistic, mask).item()
        metrics[f"{prefix}_fraction_high"] = masked_mean((statistic > upper).float(), mask=mask).item()
        metrics[f"{prefix}_fraction_low"] = (masked_mean((statistic < lower).float(), mask=mask).item()
                                             if has_lower else 0.0)
    metrics[f"{prefix}_std"] = _clamped_std(statistic, mask, lower if has_lower else 0.0, upper)
    if sequences.numel():
        metrics[f"{prefix}_seq_mean"] = sequences.mean().item()
        metrics[f"{prefix}_seq_std"] = sequences.std().item() if sequences.numel() > 1 else 0.0
        metrics[f"{prefix}_seq_max"] = sequences.max().item()
        metrics[f"{prefix}_seq_min"] = sequences.min().item()
        metrics[f"{prefix}_seq_max_deviation"] = sequences.abs().max().item()
        metrics[f"{prefix}_seq_fraction_high"] = (sequences > upper).float().mean().item()
        if has_lower:
            metrics[f"{prefix}_seq_fraction_low"] = (sequences < lower).float().mean().item()
    return metrics


MISMATCH_PREFIXES = ("rollout_corr/", "training/")  # logged under these names, not under a role's
MISMATCH_METRICS = (
    "rollout_corr/training_ppl", "rollout_corr/training_log_ppl", "rollout_corr/kl", "rollout_corr/k3_kl",
    "rollout_corr/rollout_ppl", "rollout_corr/rollout_log_ppl", "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
    "rollout_corr/ppl_ratio", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
    "rollout_corr/log_prob_abs_diff_mean", "rollout_corr/log_prob_abs_diff_max",
    "training/rollout_probs_diff_valid", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr",
)


def compute_mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the engine's, as detached 0-dim tensors (no
    host sync): verl's off-policy metrics (`rollout_corr/*`: KL(π_rollout‖π_train) and its k3
    estimate, perplexities, χ²) and debug metrics (`training/rollout_probs_diff_*`, in
    probability space), plus ember's `rollout_corr/log_prob_abs_diff_mean|max`:
    |log π_train − log π_rollout| over the valid tokens. Every key of `MISMATCH_METRICS` is
    always present (0 where the mask holds no token), so ranks reduce the same keys."""
    with torch.no_grad():
        mask = response_mask.bool()
        train_log_probs, rollout_log_probs = train_log_probs.float(), rollout_log_probs.float()
        if not mask.any():
            return {key: torch.zeros((), device=train_log_probs.device) for key in MISMATCH_METRICS}
        log_ratio = train_log_probs - rollout_log_probs
        train_mean = masked_mean(train_log_probs, mask=mask, dim=-1)
        rollout_mean = masked_mean(rollout_log_probs, mask=mask, dim=-1)
        log_ppl_diff = rollout_mean - train_mean
        safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        sequence_log_ratio = masked_sum(log_ratio, mask=mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        absolute = log_ratio.abs()
        train_probs, rollout_probs = torch.exp(train_log_probs)[mask], torch.exp(rollout_log_probs)[mask]
        probs_diff = (train_probs - rollout_probs).abs()
        values = (
            torch.exp(-train_mean).mean(), (-train_mean).mean(),
            masked_mean(-log_ratio, mask=mask), masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask=mask),
            torch.exp(-rollout_mean).mean(), (-rollout_mean).mean(),
            log_ppl_diff.mean(), log_ppl_diff.abs().mean(), log_ppl_diff.max(), log_ppl_diff.min(),
            torch.exp(log_ppl_diff).mean(),
            masked_mean(torch.exp(safe).square(), mask=mask) - 1.0, torch.exp(2.0 * sequence_log_ratio).mean() - 1.0,
            masked_mean(absolute, mask=mask), _masked_max(absolute, mask),
            torch.ones((), device=probs_diff.device), probs_diff.max(), probs_diff.mean(),
            probs_diff.std() if probs_diff.numel() > 1 else torch.zeros((), device=probs_diff.device),
            torch.corrcoef(torch.stack([train_probs, rollout_probs]))[0, 1] if probs_diff.numel() > 1
            else torch.zeros((), device=probs_diff.device),
        )
        return dict(zip(MISMATCH_METRICS, values))


@dataclass(frozen=True)
class RolloutCorrection:
    """The batch's correction: IS weights (None without `rollout_is`), the response mask after
    rejection, and every `rollout_corr/*` metric."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def compute_rollout_correction(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, *, rollout_is: str | None, rollout_is_threshold: float,
                               rollout_is_batch_normalize: bool,
                               rejection: Mapping[str, tuple[float | None, float]] | None,
                               sum_over_ranks: SumOverRanks | None = None) -> RolloutCorrection:
    """verl's decoupled mode on one batch: weights and rejection from log π_old − log π_rollout
    (`sum_over_ranks`: see `compute_rollout_is_weights`)."""
    if not response_mask.bool().any():
        raise ValueError("rollout correction needs at least one valid response token")
    log_ratio = train_log_probs - rollout_log_probs
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                                         rollout_is_batch_normalize, sum_over_ranks)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rejection:
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rejection)
        metrics.update(rs_metrics)
    prefixed = {f"rollout_corr/{key}": value for key, value in metrics.items()}
    prefixed.update({key: value.item() for key, value in
                     compute_mismatch_metrics(train_log_probs, rollout_log_probs, response_mask).items()})
    return RolloutCorrection(weights=weights, response_mask=mask, metrics=prefixed)


@dataclass(frozen=True)
class BypassCorrection:
    """verl's bypass mode, as the actor applies it: old log-probs are the rollout's (no forward for
    them), and weights and rejection come from log π_θ − log π_rollout in each micro-batch of the
    update. With `loss_type="ppo_clip"` the PPO ratio π_θ/π_rollout is the correction, so no weights
    multiply the loss (verl: they would count it twice), only the rejection applies; with
    "reinforce" the loss is REINFORCE times the (truncated) weights."""

    loss_type: str  # "ppo_clip" or "reinforce"
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rejection: Mapping[str, tuple[float | None, float]] | None

    def measure(self, log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                sum_over_ranks: SumOverRanks | None = None) -> RolloutCorrection:
        """The micro-batch's correction from the current (detached) log-probs against the rollout's;
        `weights` is None unless the loss is REINFORCE with `rollout_is` set. `sum_over_ranks` (the
        engine's, `LossContext`): the batch normalisation's mean is over every data-parallel rank's
        micro-batch, as verl's; every rank measures the same number of micro-batches."""
        correction = compute_rollout_correction(
            log_probs.detach(), rollout_log_probs, response_mask, rollout_is=self.rollout_is,
            rollout_is_threshold=self.rollout_is_threshold, rollout_is_batch_normalize=self.rollout_is_batch_normalize,
            rejection=self.rejection, sum_over_ranks=sum_over_ranks)
        weights = correction.weights if self.loss_type == "reinforce" else None
        return RolloutCorrection(weights=weights, response_mask=correction.response_mask, metrics=correction.metrics)
