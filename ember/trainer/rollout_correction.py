"""The trainer's side of rollout correction (verl's `algorithm.rollout_correction`).

Decoupled mode (`bypass_mode=false`): once a step's batch holds both the engine's log-probs
(`rollout_log_probs`) and the actor's old ones, `correct_rollout` measures the mismatch (always)
and, with `rollout_is` or `rollout_rs` set, puts the truncated importance weights on the batch
(`rollout_is_weights`, which multiply each token's policy loss in the actor) and takes rejected
tokens out of its `response_mask` (so out of advantages, values and every loss). When neither is
set and the batch makes one update, the trainer computes no old log-probs and the actor logs the
same metrics from its own forward, which is π_old there (`workers/actor.py`).

Bypass mode (`bypass_mode=true`): the rollout's log-probs are the old ones (`use_rollout_log_probs`,
no forward for them), so there is nothing to compare here; the actor measures π_θ against
π_rollout in every micro-batch of its update and applies weights and rejection there
(`bypass_correction`, `algorithms.BypassCorrection`); the `rollout_corr/*` metrics are that gap.
"""

from __future__ import annotations

from ember.algorithms import BypassCorrection, compute_rollout_correction
from ember.config.rollout_correction import parse_rejection
from ember.config.schema.algorithm import RolloutCorrectionConfig
from ember.data.batch import Batch


def needs_old_log_probs(config: RolloutCorrectionConfig) -> bool:
    """Decoupled correction compares the rollout with π_old, so it needs π_old even for one update."""
    return config.enabled and not config.bypass_mode


def use_rollout_log_probs(batch: Batch, config: RolloutCorrectionConfig) -> bool:
    """Bypass mode: the rollout's log-probs become `batch.old_log_probs` (True), no forward needed."""
    if config.bypass_mode:
        batch.old_log_probs = batch.rollout_log_probs
    return config.bypass_mode


def bypass_correction(config: RolloutCorrectionConfig) -> BypassCorrection | None:
    """What the actor's loss applies in bypass mode (None in decoupled mode)."""
    if not config.bypass_mode:
        return None
    rejection = parse_rejection(config.rollout_rs, config.rollout_rs_threshold) if config.rollout_rs else None
    return BypassCorrection(loss_type=config.loss_type, rollout_is=config.rollout_is,
                            rollout_is_threshold=config.rollout_is_threshold,
                            rollout_is_batch_normalize=config.rollout_is_batch_normalize, rejection=rejection)


def correct_rollout(batch: Batch, config: RolloutCorrectionConfig) -> dict[str, float]:
    """Applies the configured decoupled correction to `batch` in place; its `rollout_corr/*` and
    `training/rollout_*` metrics. A batch without both log-probs is left alone (no metrics), and so
    is one in bypass mode, whose old log-probs are the rollout's own (the actor measures instead)."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None or config.bypass_mode:
        return {}
    rejection = parse_rejection(config.rollout_rs, config.rollout_rs_threshold) if config.rollout_rs else None
    correction = compute_rollout_correction(
        batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, rollout_is=config.rollout_is,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize, rejection=rejection)
    if config.enabled:
        batch.rollout_is_weights = correction.weights
        batch.response_mask = correction.response_mask
    return correction.metrics
