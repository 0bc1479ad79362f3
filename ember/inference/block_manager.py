"""BlockManager: hands out the KV cache's fixed-size blocks to sequences and takes them back.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots. Each sequence
owns a block table (its block ids in order); token t of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`.

The n samples of one prompt share its prefill: the prompt is computed once into the first
sample's blocks, the other samples point at the same full blocks (a reference count per
block says how many tables hold it) and get their own copy of the last, partly filled
block, since each of them will write its own tokens there. Full shared blocks are never
written again, so no other copy-on-write is needed. A block returns to the free pool when
its count drops to zero.
"""

from __future__ import annotations

from collections import deque

from ember.inference.sequence import Sequence


class BlockManager:
    """Allocation, sharing and release of KV-cache blocks for sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs at least one block of one slot; got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._reference_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free_blocks)

    def blocks_for_group(self, num_tokens: int, num_samples: int) -> int:
        """Blocks a group of `num_samples` sequences sharing a `num_tokens`-token prefix needs after prefill."""
        full, partial = divmod(num_tokens, self.block_size)
        return full + (num_samples if partial else 0)

    def can_allocate_group(self, group: list[Sequence]) -> bool:
        """Whether the free pool holds the blocks `allocate_group` would take for `group`."""
        return self.blocks_for_group(len(group[0]), len(group)) <= self.num_free_blocks

    def allocate_group(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Give every sequence of `group` (same tokens) block tables for its tokens, sharing full blocks.

        The first sequence gets blocks for all tokens; the others share its full blocks and get
        a fresh block for the partial last one. Returns the (source, destination) block copies
        to make once the first sequence's keys and values are written (after the prefill).
        """
        leader = group[0]
        if any(sequence.block_table for sequence in group):
            raise RuntimeError("allocate_group called for a sequence that already holds blocks")
        if not self.can_allocate_group(group):
            raise RuntimeError(
                f"allocate_group needs {self.blocks_for_group(len(leader), len(group))} blocks, "
                f"{self.num_free_blocks} are free; check can_allocate_group first"
            )
        full, partial = divmod(len(leader), self.block_size)
        shared = [self._take() for _ in range(full)]
        leader.block_table = list(shared)
        if partial:
            leader.block_table.append(self._take())
        copies = []
        for follower in group[1:]:
            for block in shared:
                self._reference_counts[block] += 1
            follower.block_table = list(shared)
            if partial:
                own_block = self._take()
                follower.block_table.append(own_block)
                copies.append((leader.block_table[-1], own_block))
        return copies

    def blocks_missing(self, sequence: Sequence, num_tokens: int | None = None) -> int:
        """Blocks `sequence` still needs before its first `num_tokens` tokens (default: all it has) have slots."""
        num_tokens = len(sequence) if num_tokens is None else num_tokens
        return max(0, -(-num_tokens // self.block_size) - len(sequence.block_table))

    def try_append(self, sequence: Sequence, num_tokens: int) -> bool:
        """Give `sequence` slots for its first `num_tokens` tokens if the free pool holds the blocks they need;
        whether it did."""
        if self.blocks_missing(sequence, num_tokens) > self.num_free_blocks:
            return False
        self.append_slot(sequence, num_tokens)
        return True

    def append_slot(self, sequence: Sequence, num_tokens: int | None = None) -> None:
        """Make sure `sequence`'s first `num_tokens` tokens (default: all it has) have slots, taking new blocks."""
        for _ in range(self.blocks_missing(sequence, num_tokens)):
            sequence.block_table.append(self._take())

    def free(self, sequence: Sequence) -> None:
        """Release `sequence`'s blocks; a block shared with other samples stays until they release it too."""
        for block in reversed(sequence.block_table):
            self._reference_counts[block] -= 1
            if self._reference_counts[block] == 0:
                self._free_blocks.append(block)
        sequence.block_table = []

    def slot(self, sequence: Sequence, position: int) -> int:
        """Index, in the flattened cache (num_blocks x block_size slots), of token `position` of `sequence`."""
        block_index, offset = divmod(position, self.block_size)
        return sequence.block_table[block_index] * self.block_size + offset

    def _take(self) -> int:
        block = self._free_blocks.popleft()
        self._reference_counts[block] = 1
        return block
