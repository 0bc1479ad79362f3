"""The rollout interface: what every generation engine takes, returns and promises.

A rollout engine turns prompts into sampled responses for the RL loop. It knows only token
ids: tokenisation and chat templates happen before it, decoding after it. Besides the
tokens it returns the log-probability of each sampled token, so that the trainer can
compare the rollout policy with the training policy (importance ratios, mismatch metrics).

Engines share memory with training in the hybrid setup, so the interface also has
`update_weights` (receive the trained weights) and `sleep` / `wake` (hand accelerator
memory to training between generations and take it back).

What a call asks for (`SamplingParams`, NLA's `Injection`) are ember's engine's own records
(`ember/inference/request.py`), part of this interface too: every engine is asked in one vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from ember.inference.request import INJECTION_MODES, Injection, SamplingParams

__all__ = ["INJECTION_MODES", "AgentStats", "FinishReason", "Injection", "RolloutEngine", "RolloutOutput", "SamplingParams"]

FinishReason = Literal["stop", "length"]


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
    policy_version: int = 0
    """The version of the weights that generated it (the training step whose update made them; 0: the
    weights loaded at the start), stamped by the rollout role."""
    response_mask: list[int] | None = None
    """Multi-turn: 1 on each token the model sampled, 0 on tool and template tokens (their log-probs are 0);
    None: every token is the model's, up to and including its first stop token."""
    agent: AgentStats | None = None
    """Multi-turn: what the sample's agent loop did."""


@dataclass
class AgentStats:
    """One multi-turn sample's turns and tool calls (`ember/agent/loop.py`)."""

    assistant_turns: int = 0
    tool_turns: int = 0
    tool_calls: int = 0
    """Calls run (at most multi_turn.max_parallel_calls per turn)."""
    tool_errors: int = 0
    """Calls (and end-of-sample calc_reward/release calls) that raised, timed out, or named no tool."""
    malformed_tool_calls: int = 0
    """<tool_call> blocks that did not parse (not run)."""
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """Each tool's calc_reward for the sample, by tool name."""


class RolloutEngine(ABC):
    """Generates responses from token-id prompts; implemented by the hf and ember engines."""

    shares_training_weights: bool = False
    """True when the engine generates with the training module itself (the hybrid engine at
    world size 1): the trainer then never sends it weights."""
    tensor_parallel_size: int = 1
    """Consecutive ranks one engine replica spans (they generate the same prompts together)."""

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
