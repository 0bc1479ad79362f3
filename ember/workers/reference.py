"""The reference role: the frozen starting policy whose log-probs anchor the KL term.

Its engine is a forward-only copy of the starting model, or with LoRA the actor's own engine: the
reference's forwards run with the adapter off (`TrainEngine.adapters_disabled`), which computes the
starting model exactly, since the base weights are frozen (no second copy of the weights)."""

from __future__ import annotations

import torch

from ember.data.batch import Batch
from ember.engines.base import MicroBatchSpec, TrainEngine
from ember.workers.engine_role import EngineRole


class Reference(EngineRole):
    """Log-probs of responses under the frozen policy, at the rollout's temperature."""

    def __init__(self, engine: TrainEngine, micro_batch: MicroBatchSpec, temperature: float):
        super().__init__(engine)
        self.micro_batch = micro_batch  # actor_rollout_ref.ref.log_prob_* sizes
        self.temperature = temperature

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        with self.engine.resident(), self.engine.adapters_disabled():
            return self.engine.forward(batch, self.micro_batch, temperature=self.temperature).log_probs
