"""What a generate call asks of ember's engine: how to sample (`SamplingParams`) and, for NLA, a vector to write
over one prompt token (`Injection`).

These records live here, with the engine, because the engine is the lowest layer that reads them; the rollout
interface (`ember.rollout.base`) takes the same records, so every rollout engine (hf and ember) is asked in one
vocabulary and `ember.rollout` imports `ember.inference`, never the other way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; the same fields mean the same thing in every engine."""

    n: int = 1
    """Samples drawn per prompt (the group size of GRPO)."""
    temperature: float = 1.0
    """Divides the logits before sampling; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 = off."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 or 0 = off (verl writes -1, as vLLM does)."""
    max_new_tokens: int = 512
    """Most tokens generated per response; a response that reaches it finishes with "length"."""
    do_sample: bool = True
    """Sample from the distribution; False decodes greedily (argmax) whatever the temperature."""
    ignore_eos: bool = False
    """Keep generating past stop tokens until max_new_tokens (benchmarks, length tests)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (EOS, end-of-turn); the stop token is kept in the response."""
    seed: int | None = None
    """Seed for the sampling random numbers; the same seed and inputs give the same samples."""
    first_prompt_index: int = 0
    """Where this call's prompts start in the whole batch. ember's engine seeds each sample from
    its place in the whole batch, so a batch split over data-parallel ranks (each rank's call
    starting at its share's index) draws what one rank generating it all would draw."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n={self.n}: set n to at least 1 sample per prompt")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature={self.temperature}: set a temperature >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p={self.top_p}: set top_p in (0, 1] (1 = off)")
        if self.top_k < -1:
            raise ValueError(f"sampling top_k={self.top_k}: set top_k to a positive count, or -1 / 0 for off")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens}: set it to at least 1")

    @property
    def greedy(self) -> bool:
        """Whether decoding picks the argmax token (do_sample off or temperature 0)."""
        return not self.do_sample or self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        """Whether top-k truncation applies (top_k -1 and 0 both mean off)."""
        return self.top_k > 0


INJECTION_MODES = ("replace", "add")
"""How an injected vector meets the token's embedding output: replace it (the NLA fork's), or be added to it."""


@dataclass(frozen=True)
class Injection:
    """NLA: a vector written over one prompt token's input embedding during prefill."""

    position: int
    """Index of the token in the prompt's token ids (its position id)."""
    vector: Tensor
    """[H] the vector (hidden size of the model), cast to the engine's dtype."""
    mode: str = "replace"
    """replace: the vector is the embedding output; add: it is added to it."""
