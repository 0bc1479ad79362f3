"""EmberRollout: the RolloutEngine on ember's own generation engine (`ember.inference.LLMEngine`).

`update_weights` copies the trained tensors into the engine's weights in place (the names
are the HF checkpoint's, as `named_parameters_for_sync` sends them), or, once
`share_training_weights` is called, takes them as the engine's own storage where layouts
match. `sleep` frees the KV cache for training and `wake` allocates it again (a cache of at
most 5% of the accelerator's memory stays: `LLMEngine.free_kv_cache`); the weights stay where
they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from ember.inference.config import EngineConfig
from ember.inference.engine import LLMEngine
from ember.rollout.base import Injection, RolloutEngine, RolloutOutput, SamplingParams


class EmberRollout(RolloutEngine):
    """Rollout engine backed by ember's paged-KV-cache engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tensor_parallel_size = engine.tensor_parallel.size
        self._asleep = False
        self.share_weights = False

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig) -> EmberRollout:
        """A rollout engine for the HF model directory `path`."""
        return cls(LLMEngine.from_pretrained(path, config))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections: Sequence[Injection | None] | None = None) -> list[RolloutOutput]:
        """`sampling.n` samples per prompt, grouped by prompt, each with its tokens' rollout log-probs
        (NLA: `injections`, one per prompt, written over a prompt token's embedding in prefill)."""
        if self._asleep:
            raise RuntimeError("EmberRollout.generate called while asleep: call wake() first")
        return [
            RolloutOutput(
                prompt_index=sequence.sequence_id // sampling.n,
                token_ids=sequence.generated_token_ids,
                log_probs=sequence.log_probs,
                finish_reason=sequence.finish_reason,
            )
            for sequence in self.engine.generate(prompts, sampling, injections)
        ]

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Take trained tensors (model's own names; whole, or under tensor parallelism this rank's part):
        copied in place, or shared after `share_training_weights` where layouts match."""
        self.engine.load_weights(named_tensors, share=self.share_weights)

    def share_training_weights(self) -> None:
        """From now on take the tensors `update_weights` receives as the engine's own storage where
        shape, dtype and device match: for the training engine's live parameters (one rank, no
        cast, no offload) the engine then holds no second copy and sees each optimizer step."""
        self.share_weights = True

    def sleep(self) -> None:
        """Free the KV cache for training; `generate` is refused until `wake`."""
        self.engine.free_kv_cache()
        self._asleep = True

    def wake(self) -> None:
        """Allocate the KV cache again."""
        self.engine.allocate_kv_cache()
        self._asleep = False
