"""Sequence: one sample being generated, its tokens so far, its KV blocks and its sampling seed.

A prompt asked for n samples becomes n sequences with the same prompt tokens; they are
prefilled together once (see `Scheduler`) and share the prompt's full KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ember.inference.request import Injection


class SequenceStatus(Enum):
    """Where a sequence is: queued for prefill, holding a slot, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt plus the tokens generated for it so far; identity (not value) equality."""

    sequence_id: int
    """Position of this sample in the engine's output list (prompt index x n + sample index)."""
    prompt_length: int
    """Tokens of the prompt at the start of `token_ids`."""
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    seed: int
    """This sample's 32-bit sampling seed: with the token's position it fixes the draw (see `sampling.py`)."""
    max_new_tokens: int
    """Most tokens to generate; reaching it finishes the sequence with "length"."""
    log_probs: list[float] = field(default_factory=list)
    """Log-prob of each generated token under the rollout policy."""
    block_table: list[int] = field(default_factory=list)
    """KV-cache block ids holding this sequence's tokens, in order."""
    injection: Injection | None = None
    """NLA: the vector written over one prompt token's embedding whenever the prompt is prefilled
    (again after a preemption); the n samples of a prompt carry the same one."""
    cached_tokens: int = 0
    """Tokens at the start of `token_ids` whose keys and values `block_table` holds already: a continued turn's
    earlier context (`Scheduler.continue_held`); its prefill computes the rest. 0 for a new prompt."""
    hold_kv: bool = False
    """Keep the blocks when this sequence finishes (an agent's turn that a tool's answer may continue)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    """"stop" or "length" once finished."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.prompt_length

    @property
    def generated_token_ids(self) -> list[int]:
        """The response so far, without the prompt."""
        return self.token_ids[self.prompt_length :]

    def append(self, token_id: int, log_prob: float) -> None:
        """Record one sampled token and its log-prob."""
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)

    def extend(self, token_ids: list[int], log_probs: list[float]) -> None:
        """Record sampled tokens and their log-probs, in order."""
        self.token_ids += token_ids
        self.log_probs += log_probs
