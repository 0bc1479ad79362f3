"""Scheduler: continuous batching: which sequences the next engine step prefills or decodes.

Each step is either a prefill (new prompts, as many as fit in `max_num_batched_tokens`,
the free slots of `max_num_seqs` and the free KV blocks) or a decode window (up to
`lookahead` new tokens for every running sequence, run on the device without coming back
here: blocks are reserved for all of them up front). Prefill goes first whenever a prompt
fits, so a slot freed by a finished sequence (stop token or max_new_tokens) is refilled at
the next step.

The n samples of one prompt wait as one group and are prefilled once (see
`BlockManager.allocate_group`). When a decode step finds no free block for a sequence,
the most recently started sequence is preempted: its blocks are freed and it waits at the
front of the queue, to be prefilled again from its prompt and the tokens it has so far
(recompute), keeping its log-probs.

A sequence submitted with `hold_kv` keeps its blocks when it finishes (`held`): an agent's turn
that a tool's answer continues (`continue_held`) is then prefilled from where the turn ended,
over the keys and values already in its blocks, instead of from its first token. Held blocks
are given back when the agent releases them, and whenever the waiting prompts need the room
(oldest first): that turn is then prefilled whole, as if nothing had been held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.inference.block_manager import BlockManager
from ember.inference.config import EngineConfig
from ember.inference.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens start .. start + length - 1 of a group's shared tokens, computed once for all its sequences."""

    group: list[Sequence]
    start: int
    length: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the group's last token (its sequences then sample)."""
        return self.start + self.length == len(self.group[0])


@dataclass
class ScheduledStep:
    """What one engine step computes."""

    is_prefill: bool
    """True: prefill `chunks`; False: decode `decode_sequences`."""
    chunks: list[PrefillChunk] = field(default_factory=list)
    """Prefill only: the token ranges computed, one per group; only the last may stop short of its group's end."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """Prefill only: (source, destination) KV blocks to copy after the forward (a sample's own partial block)."""
    decode_sequences: list[Sequence] = field(default_factory=list)
    """Decode only: sequences that each get the window's new tokens (slots reserved for all of them)."""

    @property
    def groups(self) -> list[list[Sequence]]:
        """Prefill only: the groups whose prompt this step completes (they sample their first token)."""
        return [chunk.group for chunk in self.chunks if chunk.completes]

    @property
    def sequences(self) -> list[Sequence]:
        """Every sequence that samples a token in this step, in the order of the step's logits rows."""
        if self.is_prefill:
            return [sequence for group in self.groups for sequence in group]
        return self.decode_sequences


class Scheduler:
    """Queues of waiting groups and running sequences; picks each step's work and retires finished sequences."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []
        self.partial: PrefillChunk | None = None
        """The group part-way through a chunked prefill (holding its blocks), and the chunk computed last."""
        self._partial_copies: list[tuple[int, int]] = []
        self.held: dict[int, tuple[Sequence, list[int]]] = {}
        """Finished `hold_kv` sequences by sequence id, oldest first, still holding their blocks, each with a copy
        of the tokens whose keys and values those blocks hold (what a continuation must extend)."""

    def add_group(self, group: list[Sequence]) -> None:
        """Queue the samples of one prompt; more than `max_num_seqs` samples are queued as several groups."""
        for start in range(0, len(group), self.config.max_num_seqs):
            self.waiting.append(group[start : start + self.config.max_num_seqs])

    def continue_held(self, sequence: Sequence) -> None:
        """Queue `sequence`, the next turn of the held sequence of the same id (its tokens extended), to be
        prefilled over the held blocks from the held turn's last token on; from its first token where nothing
        is held for it or its tokens do not extend the held ones."""
        held, cached = self.held.pop(sequence.sequence_id, (None, []))
        if held is not None and sequence.token_ids[: len(cached)] == cached:
            sequence.block_table, held.block_table = held.block_table, []
            sequence.cached_tokens = len(cached) - 1  # the last sampled token has no keys and values yet
        elif held is not None:
            self.block_manager.free(held)
        self.waiting.append([sequence])

    def release_held(self, sequence_id: int | None = None) -> None:
        """Give back the blocks held for one sequence id (every held sequence's with None)."""
        for key in [sequence_id] if sequence_id is not None else list(self.held):
            held, _ = self.held.pop(key, (None, None))
            if held is not None:
                self.block_manager.free(held)

    def _make_room(self, blocks: int, keep: Sequence | None = None) -> bool:
        """Free blocks until `blocks` are free: held sequences' first, oldest first, then those of continued turns
        still waiting (the last queued first; each is prefilled whole when its turn comes), never `keep`'s;
        whether any were freed."""
        released = False
        while self.held and self.block_manager.num_free_blocks < blocks:
            self.release_held(next(iter(self.held)))
            released = True
        for group in reversed(self.waiting):
            if self.block_manager.num_free_blocks >= blocks:
                break
            turn = group[0]
            if turn.cached_tokens and turn is not keep:
                self.block_manager.free(turn)
                turn.cached_tokens = 0
                released = True
        return released

    def is_finished(self) -> bool:
        """Whether no sequence waits, is being prefilled or runs."""
        return not self.waiting and not self.running and self.partial is None

    def schedule(self, lookahead: int = 1) -> ScheduledStep:
        """The next step: a prefill of the waiting groups that fit, else a decode window of `lookahead` steps."""
        step = self._schedule_prefill()
        if step.chunks:
            return step
        if not self.running and self.waiting and self._make_room(self.block_manager.num_blocks, self.waiting[0][0]):
            return self.schedule(lookahead)  # the held turns' blocks went back: the waiting prompt fits now
        if not self.running:
            group = self.waiting[0]
            raise RuntimeError(
                f"the KV cache ({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens) "
                f"cannot hold {len(group)} samples of a {len(group[0])}-token prompt: raise num_kv_blocks "
                f"(or gpu_memory_utilization), or lower n"
            )
        return self._schedule_decode(lookahead)

    def _schedule_prefill(self) -> ScheduledStep:
        """Prompt tokens up to `max_num_batched_tokens`: the part-prefilled group first, then whole
        waiting groups; with chunked prefill the last group admitted may get only the budget left."""
        step = ScheduledStep(is_prefill=True)
        budget = self.config.max_num_batched_tokens
        if self.partial is not None:
            group, start = self.partial.group, self.partial.start + self.partial.length
            budget -= self._add_chunk(step, group, start, min(len(group[0]) - start, budget), self._partial_copies)
        num_sequences = len(self.running) + (len(self.partial.group) if self.partial else 0)
        while self.waiting and budget > 0 and self.partial is None:
            group = self.waiting[0]
            leader = group[0]
            start = leader.cached_tokens  # > 0: a continued turn, its earlier context in its blocks already
            blocks = (self.block_manager.blocks_missing(leader) if start
                      else self.block_manager.blocks_for_group(len(leader), len(group)))
            fits = (
                num_sequences + len(group) <= self.config.max_num_seqs
                and (len(leader) - start <= budget or self.config.enable_chunked_prefill)
            )
            if fits and blocks > self.block_manager.num_free_blocks:
                self._make_room(blocks, leader)  # held turns give their blocks back, oldest first
            if not fits or blocks > self.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            if start:
                self.block_manager.append_slot(leader)
                copies = []
            else:
                copies = self.block_manager.allocate_group(group)
            budget -= self._add_chunk(step, group, start, min(len(leader) - start, budget), copies)
            num_sequences += len(group)
        return step

    def _add_chunk(
        self, step: ScheduledStep, group: list[Sequence], start: int, length: int, copies: list[tuple[int, int]]
    ) -> int:
        """Schedule tokens start .. start + length - 1 of `group`; a completed group starts running
        (its samples' own copies of the shared last block are made after this step). Returns `length`."""
        chunk = PrefillChunk(group, start, length)
        step.chunks.append(chunk)
        if chunk.completes:
            step.block_copies += copies
            for sequence in group:
                sequence.status = SequenceStatus.RUNNING
            self.running += group
            self.partial, self._partial_copies = None, []
        else:
            self.partial, self._partial_copies = chunk, copies
        return length

    def _schedule_decode(self, lookahead: int) -> ScheduledStep:
        scheduled: list[Sequence] = []
        candidates = deque(self.running)
        while candidates:
            sequence = candidates.popleft()
            needed = slots_for_window(sequence, lookahead)
            while not self.block_manager.try_append(sequence, needed):
                if self._make_room(self.block_manager.blocks_missing(sequence, needed)):
                    continue  # held or waiting turns gave their blocks back before a running sequence is preempted
                victim = candidates.pop() if candidates else sequence
                self._preempt(victim)
                if victim is sequence:
                    break
            else:
                scheduled.append(sequence)
        if not scheduled:
            raise RuntimeError(
                f"the KV cache ({self.block_manager.num_blocks} blocks) cannot hold even one running sequence: "
                f"raise num_kv_blocks (or gpu_memory_utilization)"
            )
        return ScheduledStep(is_prefill=False, decode_sequences=scheduled)

    def _preempt(self, sequence: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be prefilled again with its tokens so far."""
        self.block_manager.free(sequence)
        sequence.cached_tokens = 0
        self.running.remove(sequence)
        sequence.status = SequenceStatus.WAITING
        self.waiting.appendleft([sequence])

    def finish(self, sequence: Sequence, reason: str) -> None:
        """Retire a running sequence: free its slot and blocks for the next prompt."""
        sequence.status = SequenceStatus.FINISHED
        sequence.finish_reason = reason
        self.running.remove(sequence)
        if sequence.hold_kv:
            self.release_held(sequence.sequence_id)  # an older turn of this id still held: superseded
            self.held[sequence.sequence_id] = sequence, list(sequence.token_ids)
        else:
            self.block_manager.free(sequence)


def slots_for_window(sequence: Sequence, steps: int, ahead: int = 0) -> int:
    """Tokens of `sequence` that need KV slots for a window of `steps` decode steps, after `ahead` tokens that a
    window before it samples (not yet appended).

    Step i feeds the token at position len - 1 + i, so the window writes positions up to
    len + steps - 2; a sequence never feeds its last allowed token (prompt + max_new_tokens - 1).
    """
    length, last_useful = len(sequence.token_ids) + ahead, sequence.prompt_length + sequence.max_new_tokens - 1
    return max(length, min(length + steps - 1, last_useful))
