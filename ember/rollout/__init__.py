"""Rollout engines: the RolloutEngine interface, its records, and `build_rollout` to pick one by name.

The name is `actor_rollout_ref.rollout.name` in the config. `hf` generates with
transformers on the training module (hybrid engine); `ember` is ember's own engine
(`ember.inference`), which holds its own copy of the weights. Imports point one way: this package
uses `ember.inference` (its engine and its request records), and `ember.inference` knows nothing of it.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.rollout.base import AgentStats, Injection, RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["AgentStats", "HFRollout", "Injection", "RolloutEngine", "RolloutOutput", "SamplingParams", "build_rollout"]

_EXTERNAL_ENGINES = ("vllm", "sglang")


def __getattr__(name: str):
    """`HFRollout` is imported on first use: transformers' generation stack is start-up time that a run
    on ember's own engine never needs."""
    if name == "HFRollout":
        from ember.rollout.hf import HFRollout

        return HFRollout
    raise AttributeError(f"module 'ember.rollout' has no attribute {name!r}")


def build_rollout(
    name: str,
    model: nn.Module,
    pad_token_id: int,
    max_batch_size: int = 1024,
    dtype: torch.dtype | None = None,
    model_path: str | None = None,
    engine_config=None,
) -> RolloutEngine:
    """The rollout engine called `name`: `hf` generates with the training module `model`
    itself (hybrid engine); `ember` loads its own copy from `model_path` with
    `engine_config` (an `ember.inference.config.EngineConfig`) and is sent the trained
    weights before each generation."""
    if name == "hf":
        from ember.rollout.hf import HFRollout

        return HFRollout(model, pad_token_id, max_batch_size=max_batch_size, dtype=dtype)
    if name == "ember":
        if model_path is None or engine_config is None:
            raise ValueError("rollout.name=ember needs the model path and an EngineConfig")
        # Imported on first use, as HFRollout: the engine's models and kernels are start-up time a process
        # that never builds one (the driver of a multi-GPU run) does not need.
        from ember.rollout.ember_rollout import EmberRollout

        return EmberRollout.from_pretrained(model_path, engine_config)
    if name in _EXTERNAL_ENGINES:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name}: {name} is not available in ember; "
            "use actor_rollout_ref.rollout.name=ember (ember's own engine) or hf"
        )
    raise ValueError(
        f"actor_rollout_ref.rollout.name={name} is not a rollout engine; choose one of: hf, ember"
    )
