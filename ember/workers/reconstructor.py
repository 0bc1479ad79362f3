"""NLA's critic role, the reconstructor: predicts each sample's activation vector from the explanation alone
and learns to do so by plain MSE on the raw vectors.

Its batches (`reconstruction_batch`) hold `critic.critic_prompt` (when set) followed by the
response tokens, EOS included, ending in the last column, with the target vectors as
`activation_vectors` and no injection. The prediction is read at the last token
(`models/reconstructor.py`). The fork's critic metrics are computed here from a batch's
predictions and targets (`reconstruction_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ember.data.batch import Batch
from ember.engines.base import LossContext, ModelOutput, TrainEngine
from ember.workers.critic import CriticBatching
from ember.workers.engine_role import EngineRole
from ember.workers.minibatch import average_metrics, iterate_mini_batches


@dataclass(frozen=True)
class ReconstructorOptions(CriticBatching):
    """The slice of `critic` the reconstructor needs: its batching (its loss, MSE, has no settings)."""


def reconstruction_batch(critic_prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], targets: Tensor,
                         pad_token_id: int) -> Batch:
    """The reconstructor's batch: `critic_prompt_ids` + each response as the left-padded "prompt", so every
    sample's last real token sits in the last prompt column, and one empty response column; targets as
    `activation_vectors`."""
    if any(not response for response in responses):
        raise ValueError("an empty response leaves the reconstructor no token to read the vector at")
    batch = Batch.from_rollout([list(critic_prompt_ids) + list(response) for response in responses],
                               [[] for _ in responses], pad_token_id=pad_token_id, response_length=1)
    return batch.with_fields(activation_vectors=targets.float())


def squared_errors(predictions: Tensor, targets: Tensor) -> Tensor:
    """[B] mean over dimensions of (prediction - target)²: the negative of the fork's reward."""
    return (predictions.float() - targets.float()).pow(2).mean(dim=-1)


def reconstruction_metrics(predictions: Tensor, targets: Tensor) -> dict[str, float]:
    """The fork's critic metrics of one batch, and ember's `fve` (fraction of variance explained, against
    predicting the batch's mean vector)."""
    predictions, targets = predictions.float(), targets.float()
    loss = squared_errors(predictions, targets).mean()
    zero = targets.pow(2).mean()
    mean_prediction = (targets - targets.mean(dim=0, keepdim=True)).pow(2).mean()
    target_norm_sq = targets.pow(2).sum(dim=-1).mean()
    by_mean = loss / mean_prediction if mean_prediction > 0 else torch.tensor(float("nan"))
    metrics = {
        "critic/critic_loss": loss, "critic/mse_with_zero_pred": zero,
        "critic/mse_with_mean_pred_over_batch": mean_prediction,
        "critic/normalized_mse": loss / target_norm_sq if target_norm_sq > 0 else torch.tensor(float("nan")),
        "critic/normalized_mse_by_zero": loss / zero if zero > 0 else torch.tensor(float("nan")),
        "critic/normalized_mse_by_mean_pred_over_batch": by_mean, "critic/fve": 1 - by_mean,
    }
    for name, values in (("pred", predictions), ("target", targets)):
        metrics[f"critic/{name}_activation_mean"] = values.mean()
        metrics[f"critic/{name}_activation_std"] = values.std()
        metrics[f"critic/{name}_activation_avg_norm"] = values.norm(dim=-1).mean()
    return {key: float(value) for key, value in metrics.items()}


class Reconstructor(EngineRole):
    """Predicts activation vectors from text and fits them (see the module docstring)."""

    def __init__(self, engine: TrainEngine, options: ReconstructorOptions):
        super().__init__(engine)
        self.options = options

    def predict(self, batch: Batch) -> Tensor:
        """[B, H] float32 predictions, without gradients (the reward's, before the update)."""
        with self.engine.resident():
            return self.engine.forward(batch, self.options.forward_micro_batch).predictions

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        options = self.options
        with self.engine.resident():
            results = [self.engine.train_mini_batch(mini_batch, mse_loss, options.micro_batch)
                       for mini_batch in iterate_mini_batches(batch, options.mini_batch_samples, options.ppo_epochs,
                                                              options.shuffle, seed=options.seed + step)]
        return {f"critic/{key}": value for key, value in average_metrics(results).items()}


def mse_loss(output: ModelOutput, batch: Batch, context: LossContext) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch's MSE (mean over samples and dimensions)."""
    errors = squared_errors(output.predictions, batch.activation_vectors.to(output.predictions.device))
    return errors.sum() / context.num_sequences, {}
