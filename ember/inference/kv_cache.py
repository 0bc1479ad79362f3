"""KVCache: the paged key/value cache of every layer, and how many blocks of it fit in memory.

Each layer holds a key and a value tensor of shape (num_blocks, block_size, kv_heads,
head_dim), views of one allocation; the `BlockManager` decides which sequence owns which
block. `free` drops the tensors (the engine's `sleep`) and `allocate` creates them again
(`wake`): the cache's contents never outlive a `generate` call, so nothing is saved across.
One allocation of one size tends to come back at the same address (`address`), which lets
the engine keep CUDA graphs captured over it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class KVCache:
    """Key and value blocks for all layers of one model."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.block_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.layers: list[tuple[Tensor, Tensor]] = []
        self.allocate()

    @property
    def is_allocated(self) -> bool:
        """Whether the cache tensors exist (False between `free` and `allocate`)."""
        return bool(self.layers)

    def allocate(self) -> None:
        """Create the cache tensors, zeroed; nothing to do if they exist.

        Zeroed, not empty: attention gathers whole blocks and masks the unused slots, and a
        masked NaN left in fresh memory would still poison the weighted sum (0 * NaN).
        """
        if self.layers:
            return
        storage = torch.zeros((self.num_layers, 2, *self.block_shape), dtype=self.dtype, device=self.device)
        self.layers = [(storage[layer, 0], storage[layer, 1]) for layer in range(self.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes the cache takes while allocated (every layer's keys and values, the trash block included)."""
        return self.num_layers * 2 * math.prod(self.block_shape) * self.dtype.itemsize

    @property
    def address(self) -> int | None:
        """Where the cache's memory starts (None while freed)."""
        return self.layers[0][0].data_ptr() if self.layers else None

    def free(self) -> None:
        """Drop the cache tensors so their memory can be reused (the caller empties the allocator's cache)."""
        self.layers = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer: a sample's own copy of a shared partial block."""
        if not copies:
            return
        sources = torch.tensor([source for source, _ in copies], device=self.device)
        destinations = torch.tensor([destination for _, destination in copies], device=self.device)
        for keys, values in self.layers:
            keys[destinations] = keys[sources]
            values[destinations] = values[sources]


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers (keys and values)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def activation_reserve_bytes(
    hidden_size: int, intermediate_size: int, vocab_size: int, max_num_batched_tokens: int, max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """Memory a step needs besides weights and KV cache, estimated high: a full prefill's layer
    activations, every sequence's logits with their float32 copies, and 512 MiB for captured
    graphs and allocator slack."""
    prefill = max_num_batched_tokens * (6 * hidden_size + 3 * intermediate_size) * dtype.itemsize
    logits = max_num_seqs * vocab_size * (dtype.itemsize + 8)
    return prefill + logits + (512 << 20)


def kv_blocks_to_allocate(max_num_seqs: int, max_blocks_per_sequence: int, fit_in_memory: int | None = None) -> int:
    """The KV cache's size in blocks: what `max_num_seqs` sequences of full length can hold at once
    (no more can ever be in use: the scheduler runs at most that many, each within its
    `max_blocks_per_sequence`), or what fits in memory (`num_kv_blocks_for_memory`) if that is less.

    The cap matters between rollouts: the cache is zeroed at every wake and handed back at every
    sleep, so a cache sized to the memory budget alone (tens of GiB for a short-answer task) costs
    a step milliseconds of allocation and zeroing for blocks no sequence can use, and keeps that
    memory from training's caching allocator while awake.
    """
    most_in_use = max_num_seqs * max_blocks_per_sequence
    return most_in_use if fit_in_memory is None else min(fit_in_memory, most_in_use)


def num_kv_blocks_for_memory(
    total_bytes: int, free_bytes: int, memory_utilization: float, block_bytes: int, reserved_bytes: int = 0,
    own_bytes: int = 0,
) -> int:
    """Blocks that fit when the engine may fill `memory_utilization` of the device with its own weights
    (`own_bytes`, already loaded) and cache, and only `free_bytes` are free.

    As gpu_memory_utilization means in vLLM, the fraction is the engine's own: memory a colocated trainer holds
    (the actor's weights beside the rollout on the same GPU) does not count against it, but the cache never
    takes more than what is free. `reserved_bytes` (the steps' own activations, `activation_reserve_bytes`)
    comes off both.
    """
    own_budget = int(total_bytes * memory_utilization) - own_bytes
    budget = min(own_budget, free_bytes) - reserved_bytes
    blocks = budget // block_bytes
    if blocks < 1:
        gib = lambda count: f"{count / 2**30:.1f} GiB"  # noqa: E731
        raise ValueError(
            f"no room for a KV cache: gpu_memory_utilization={memory_utilization} of {gib(total_bytes)} is "
            f"{gib(total_bytes * memory_utilization)}, the engine's weights take {gib(own_bytes)} of it, "
            f"{gib(free_bytes)} is free on the device and {gib(reserved_bytes)} is kept for the steps' activations: "
            "raise gpu_memory_utilization, free memory (offload training) before waking, or lower max_num_seqs / "
            "max_num_batched_tokens"
        )
    return blocks
