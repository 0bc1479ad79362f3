"""The critic role: a value model (TrainEngine with a scalar head) and the clipped value
loss. Used by the GAE path; GRPO-family runs have no critic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.algorithms import compute_value_loss
from ember.data.batch import Batch
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput, TrainEngine
from ember.workers.engine_role import EngineRole
from ember.workers.minibatch import average_metrics, iterate_mini_batches


@dataclass(frozen=True)
class CriticBatching:
    """How the `critic` section batches a critic's work: PPO's value model and NLA's reconstructor alike."""

    mini_batch_samples: int  # ppo_mini_batch_size × rollout.n / data-parallel size: this rank's share
    micro_batch: MicroBatchSpec  # ppo_micro_batch_size_per_gpu, or ppo_max_token_len_per_gpu with use_dynamic_bsz
    forward_micro_batch: MicroBatchSpec  # forward_micro_batch_size_per_gpu, or forward_max_token_len_per_gpu
    ppo_epochs: int
    shuffle: bool
    seed: int


@dataclass(frozen=True)
class CriticOptions(CriticBatching):
    """The slice of `critic` the critic needs: its batching and its value loss."""

    cliprange_value: float
    loss_agg_mode: str
    norm_length: int


class Critic(EngineRole):
    """Estimates values of response tokens and fits them to the returns."""

    def __init__(self, engine: TrainEngine, options: CriticOptions):
        super().__init__(engine)
        self.options = options

    def compute_values(self, batch: Batch) -> torch.Tensor:
        with self.engine.resident():
            return self.engine.forward(batch, self.options.forward_micro_batch).values

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        options = self.options
        with self.engine.resident():
            results = [self.engine.train_mini_batch(mini_batch, self._loss, options.micro_batch)
                       for mini_batch in iterate_mini_batches(batch, options.mini_batch_samples, options.ppo_epochs,
                                                              options.shuffle, seed=options.seed + step)]
        return {f"critic/{key}": value for key, value in average_metrics(results).items()}

    def _loss(self, output: ModelOutput, batch: Batch, context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        """The share of the mini-batch value loss, and the micro-batch's own loss as the metric."""
        options = self.options
        arguments = dict(predicted_values=output.values, old_values=batch.values, returns=batch.returns,
                         response_mask=batch.response_mask, cliprange_value=options.cliprange_value,
                         loss_agg_mode=options.loss_agg_mode, norm_length=options.norm_length)
        share = compute_value_loss(**arguments, num_tokens=context.num_tokens, num_sequences=context.num_sequences)
        with torch.no_grad():
            local = compute_value_loss(**arguments)
        return share.loss, {"vf_loss": local.loss, "vf_clipfrac": share.clipfrac}
