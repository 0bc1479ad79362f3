"""The actor role: a TrainEngine plus the policy objective.

The actor is blind to how advantages were made: it receives a Batch whose `advantages`
(and, when needed, `old_log_probs` / `ref_log_probs`, rollout correction's
`rollout_is_weights`) are filled, and applies the policy loss + optional KL loss − entropy
bonus over mini-batches of `ppo_mini_batch_size` prompts (× `rollout.n` samples),
`ppo_epochs` times. Without old log-probs (one update per batch) its own forward is π_old,
so it logs the rollout mismatch (`rollout_corr/*`) from that forward: like its other
metrics, averaged over micro-batches and ranks (a `_max` is the mean of each micro-batch's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.algorithms import (
    MISMATCH_PREFIXES,
    BypassCorrection,
    ClipConfig,
    PolicyLossInputs,
    aggregate_loss,
    compute_mismatch_metrics,
    compute_reinforce_policy_loss,
    get_policy_loss_fn,
    kl_penalty,
)
from ember.data.batch import Batch
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput, TrainEngine
from ember.workers.engine_role import EngineRole
from ember.workers.minibatch import average_metrics, iterate_mini_batches


@dataclass(frozen=True)
class ActorOptions:
    """The slice of `actor_rollout_ref.actor` (and rollout) the actor needs."""

    mini_batch_samples: int  # ppo_mini_batch_size × rollout.n / data-parallel size: this rank's share
    micro_batch: MicroBatchSpec  # ppo_micro_batch_size_per_gpu, or ppo_max_token_len_per_gpu with use_dynamic_bsz
    log_prob_micro_batch: MicroBatchSpec  # for old log-probs: rollout.log_prob_* sizes
    ppo_epochs: int
    shuffle: bool
    policy_loss: str
    clip: ClipConfig
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float
    norm_length: float  # seq-mean-token-sum-norm's divisor: actor.loss_scale_factor, else the max response length
    seed: int
    loss_scale: float = 1.0  # the loss (and so the gradient) × this: 1/n under nla.fork_actor_gradient_scale
    bypass: BypassCorrection | None = None  # algorithm.rollout_correction.bypass_mode: how the loss corrects


class Actor(EngineRole):
    """Computes log-probs of responses and updates the policy; `version` names its weights."""

    def __init__(self, engine: TrainEngine, options: ActorOptions):
        super().__init__(engine)
        self.options = options
        reinforce = options.bypass is not None and options.bypass.loss_type == "reinforce"
        self.policy_loss_fn = compute_reinforce_policy_loss if reinforce else get_policy_loss_fn(options.policy_loss)
        self.updates = 0  # a rollout that synced at another count needs a sync
        self.version = 0
        """The training step whose update made the current weights (0: as loaded at the start); the samples
        of a rollout holding these weights carry it."""

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        with self.engine.resident():
            output = self.engine.forward(batch, self.options.log_prob_micro_batch,
                                         temperature=self.options.temperature)
        return output.log_probs

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        options = self.options
        results = []
        with self.engine.resident():
            for mini_batch in iterate_mini_batches(batch, options.mini_batch_samples, options.ppo_epochs,
                                                   options.shuffle, seed=options.seed + step):
                results.append(self.engine.train_mini_batch(
                    mini_batch, self._loss, options.micro_batch,
                    compute_entropy=True, temperature=options.temperature,
                    entropy_grad=options.entropy_coeff != 0))
        self.updates += 1
        self.version = step
        return {key if key.startswith(MISMATCH_PREFIXES) else f"actor/{key}": value
                for key, value in average_metrics(results).items()}

    def set_version(self, step: int) -> None:
        """The weights are those of training step `step` (a resume loaded its checkpoint)."""
        self.version = step

    def _loss(self, output: ModelOutput, batch: Batch, context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the mini-batch loss (normalised by the global counts), and
        metrics normalised within the micro-batch (the engine averages those over micro-batches)."""
        options = self.options
        mask = batch.response_mask
        old_log_probs = batch.old_log_probs if batch.old_log_probs is not None else output.log_probs.detach()
        counts = dict(num_tokens=context.num_tokens, num_sequences=context.num_sequences)
        aggregation = dict(mask=mask, mode=options.loss_agg_mode, norm_length=options.norm_length)
        policy_mask, weights, metrics = mask, batch.rollout_is_weights, {}
        if options.bypass is not None:  # old_log_probs are the rollout's: π_θ against them, in this forward
            correction = options.bypass.measure(output.log_probs, batch.rollout_log_probs, mask,
                                                sum_over_ranks=context.sum_over_ranks)
            policy_mask, weights, metrics = correction.response_mask, correction.weights, correction.metrics
        inputs = PolicyLossInputs(old_log_probs=old_log_probs, log_probs=output.log_probs,
                                  advantages=batch.advantages, response_mask=policy_mask,
                                  rollout_is_weights=weights)
        policy_aggregation = dict(loss_agg_mode=options.loss_agg_mode, norm_length=options.norm_length)
        policy = self.policy_loss_fn(inputs, options.clip, **policy_aggregation, **counts)
        loss = policy.loss
        with torch.no_grad():
            local_policy = self.policy_loss_fn(inputs, options.clip, **policy_aggregation)
            entropy = aggregate_loss(output.entropy, **aggregation)
        metrics.update({"pg_loss": local_policy.loss, "pg_clipfrac": policy.clipfrac, "ppo_kl": policy.ppo_kl,
                        "pg_clipfrac_lower": policy.clipfrac_lower, "entropy": entropy})
        if batch.old_log_probs is None and batch.rollout_log_probs is not None:  # this forward is π_old
            metrics.update(compute_mismatch_metrics(output.log_probs.detach(), batch.rollout_log_probs, mask))
        if options.entropy_coeff:
            loss = loss - options.entropy_coeff * aggregate_loss(output.entropy, **aggregation, **counts)
        if options.use_kl_loss:
            kl = kl_penalty(log_probs=output.log_probs, ref_log_probs=batch.ref_log_probs, kind=options.kl_loss_type)
            loss = loss + options.kl_loss_coef * aggregate_loss(kl, **aggregation, **counts)
            metrics.update(kl_loss=aggregate_loss(kl.detach(), **aggregation), kl_coef=options.kl_loss_coef)
        return loss * options.loss_scale, metrics
