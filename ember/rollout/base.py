"""The rollout interface: what every generation engine takes, returns and promises.

A rollout engine turns prompts into sampled responses for the RL loop. It knows only token
ids: tokenisation and chat templates happen before it, decoding after it. Besides the
tokens it returns the log-probability of each sampled token, so that the trainer can
compare the rollout policy with the training policy (importance ratios, mismatch metrics).

Engines share memory with training in the hybrid setup, so the interface also has
`update_weights` (receive the trained weights) and `sleep` / `wake` (hand accelerator
memory to training between generations and take it back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

FinishReason = Literal["stop", "length"]


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


@dataclass
class RolloutOutput:
    """One generated sample. Samples of prompt i sit at indices i*n .. i*n+n-1 of the output list."""

    prompt_index: int
    """Index of the prompt, in the list given to `generate`, this sample answers."""
    token_ids: list[int]
    """The response tokens, without the prompt and without padding; ends with the stop token if any."""
    log_probs: list[float]
    """Log-probability of each response token under the rollout policy (see the engine for which)."""
    finish_reason: FinishReason
    """Why the response ended: "stop" (it emitted a stop token) or "length" (max_new_tokens)."""


class RolloutEngine(ABC):
    """Generates responses from token-id prompts; implemented by the hf and ember engines."""

    shares_training_weights: bool = False
    """True when the engine generates with the training module itself (the hybrid engine at
    world size 1): the trainer then never sends it weights."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections: Sequence[Injection | None] | None = None) -> list[RolloutOutput]:
        """Sample `sampling.n` responses per prompt; returns len(prompts) * n outputs, grouped by prompt.

        `injections` (NLA): one per prompt (or None), the vector its prompt's token gets in prefill;
        engines that cannot inject refuse a call that has any."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load trained weights, given as (parameter name, full tensor) pairs in the model's own names."""

    @abstractmethod
    def sleep(self) -> None:
        """Give accelerator memory back to training; `generate` is refused until `wake`."""

    @abstractmethod
    def wake(self) -> None:
        """Take memory again after `sleep`, ready to generate."""
