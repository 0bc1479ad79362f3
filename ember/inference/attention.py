"""Attention over the paged KV cache: write each step's keys and values into their slots, attend over the cache.

One code path serves prefill and decode. The step's tokens come flat (all sequences
concatenated); `AttentionInputs` says where each sequence's queries start, how long its
context is and which blocks hold it. The pure PyTorch path gathers every sequence's blocks
into a padded (batch, context, heads, dim) tensor and calls SDPA with a mask: causal,
limited to each sequence's own context, and to a sliding window where a layer has one.
It runs on any device; it is the reference a fused kernel must match. On CUDA a decode step
reads the blocks in place (`kernels/paged_decode.py`), and a prefill of whole prompts (no
keys cached before the step: `AttentionInputs.fresh`) is causal attention over the step's own
tokens, on the flash varlen kernel (`ember/flash_varlen.py`): no gather of blocks, no mask,
and no host sync (the lengths come from the host).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.flash_varlen import causal_varlen_attention, runs_on_kernel


@dataclass
class AttentionInputs:
    """Where one step's tokens go in the cache and what each sequence attends to; shared by all layers."""

    slot_mapping: Tensor
    """(tokens,) flat cache slot of each token of the step."""
    query_lengths: Tensor
    """(sequences,) tokens of each sequence in this step (the prompt at prefill, 1 at decode)."""
    context_lengths: Tensor
    """(sequences,) tokens each sequence attends to after this step's are written (cached + new)."""
    block_tables: Tensor
    """(sequences, most blocks) block ids of each sequence, padded with 0 (padding is masked out)."""
    block_size: int
    """Tokens per block."""
    is_decode: bool
    """Every sequence has exactly one new token (the case a fused decode kernel handles)."""
    host_query_lengths: list[int] | None = None
    """Prefill: `query_lengths` as the host knows them; the longest, the padded rows and the cumulative
    lengths follow from them without a sync (None: asked of the device, which syncs)."""
    fresh: bool = False
    """Prefill with no keys cached before this step (every sequence starts at position 0): each
    sequence attends to this step's own tokens only."""
    _masks: dict[int | None, Tensor] = field(default_factory=dict, repr=False)

    @cached_property
    def most_queries(self) -> int:
        """The longest sequence's tokens in this step."""
        # A decode step knows its shape without asking the device (no sync inside a CUDA graph).
        if self.is_decode:
            return 1
        if self.host_query_lengths is not None:
            return max(self.host_query_lengths)
        return int(self.query_lengths.max())

    @cached_property
    def query_rows(self) -> Tensor | None:
        """(tokens,) each flat token's row in the padded (sequences × most queries) layout, from the host's
        lengths (None without them: the rows are then found by a boolean index, which syncs)."""
        if self.host_query_lengths is None:
            return None
        rows = [row * self.most_queries + offset for row, length in enumerate(self.host_query_lengths)
                for offset in range(length)]
        return torch.tensor(rows, device=self.query_lengths.device)

    @cached_property
    def cu_query_lengths(self) -> Tensor | None:
        """(sequences + 1,) int32 cumulative query lengths from the host's (the varlen kernel's sequence bounds)."""
        if self.host_query_lengths is None:
            return None
        return torch.tensor([0, *itertools.accumulate(self.host_query_lengths)], dtype=torch.int32,
                            device=self.query_lengths.device)

    @cached_property
    def _query_offsets(self) -> Tensor:
        """(1, most queries) 0, 1, 2, ...: a query row's offset within its sequence's step."""
        return torch.arange(self.most_queries, device=self.query_lengths.device)[None, :]

    @cached_property
    def query_valid(self) -> Tensor:
        """(sequences, most queries) which padded query rows are real tokens."""
        return self._query_offsets < self.query_lengths[:, None]

    @cached_property
    def query_index(self) -> Tensor:
        """(sequences, most queries) index of each padded query row in the flat tokens (0 for padding)."""
        query_starts = torch.cumsum(self.query_lengths, 0) - self.query_lengths
        return torch.where(self.query_valid, query_starts[:, None] + self._query_offsets, 0)

    @cached_property
    def query_positions(self) -> Tensor:
        """(sequences, most queries) position of each query token in its sequence."""
        return (self.context_lengths - self.query_lengths)[:, None] + self._query_offsets

    def mask(self, sliding_window: int | None) -> Tensor:
        """(sequences, 1, most queries, most keys) which cached keys each query may attend to."""
        if sliding_window not in self._masks:
            key_positions = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.block_tables.device)
            query_positions = self.query_positions[:, :, None]
            allowed = (key_positions[None, None, :] <= query_positions) & (
                key_positions[None, None, :] < self.context_lengths[:, None, None]
            )
            if sliding_window is not None:
                allowed &= query_positions - key_positions[None, None, :] < sliding_window
            self._masks[sliding_window] = allowed[:, None]
        return self._masks[sliding_window]


def write_kv_cache(keys: Tensor, values: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's keys and values, (tokens, kv_heads, head_dim), in their cache slots."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, keys.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, values.to(value_cache.dtype))


def paged_attention(
    queries: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    inputs: AttentionInputs,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """Attention of the step's queries (tokens, heads, head_dim) over the cache; returns (tokens, heads, head_dim).

    The keys and values of this step must already be written (`write_kv_cache`). Decode
    steps on CUDA run the Triton kernel that reads the blocks in place, a fresh prefill in
    half precision on CUDA the flash varlen kernel (`fresh_prefill_attention`); everything
    else gathers (`gathered_attention`, the reference both are tested against).
    """
    if inputs.is_decode and queries.is_cuda and kernels_support_head_dim(queries.shape[-1]):
        from ember.inference.kernels.paged_decode import paged_decode_attention

        return paged_decode_attention(
            queries, key_cache, value_cache, inputs.block_tables, inputs.context_lengths, scale, sliding_window
        )
    if inputs.fresh and inputs.host_query_lengths is not None and runs_on_kernel(queries, sliding_window):
        return fresh_prefill_attention(queries, key_cache, value_cache, inputs, scale, sliding_window)
    return gathered_attention(queries, key_cache, value_cache, inputs, scale, sliding_window)


def fresh_prefill_attention(
    queries: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    inputs: AttentionInputs,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """A prefill with nothing cached before it: the step's keys and values read back from their slots
    (just written, rotated) and each sequence's tokens attend causally to themselves on the varlen kernel."""
    keys = key_cache.flatten(0, 1)[inputs.slot_mapping].to(queries.dtype)  # (tokens, kv_heads, dim)
    values = value_cache.flatten(0, 1)[inputs.slot_mapping].to(queries.dtype)
    return causal_varlen_attention(queries, keys, values, inputs.cu_query_lengths, inputs.most_queries, scale,
                                   sliding_window)


def kernels_support_head_dim(head_dim: int) -> bool:
    """Whether ember's Triton kernels (paged decode attention, RoPE + cache write) handle this head size
    (a power of two, at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def gathered_attention(
    queries: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    inputs: AttentionInputs,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """Pure PyTorch paged attention: gather each sequence's blocks, pad, and run masked SDPA."""
    keys = key_cache[inputs.block_tables].flatten(1, 2).transpose(1, 2)  # (seqs, kv_heads, keys, dim)
    values = value_cache[inputs.block_tables].flatten(1, 2).transpose(1, 2)
    padded_queries = queries[inputs.query_index].transpose(1, 2).to(keys.dtype)  # (seqs, heads, queries, dim)
    output = F.scaled_dot_product_attention(
        padded_queries, keys, values, attn_mask=inputs.mask(sliding_window), scale=scale, enable_gqa=True
    )
    if inputs.is_decode:  # one query per sequence: no boolean indexing, which would sync inside a CUDA graph
        return output.transpose(1, 2)[:, 0]
    if inputs.query_rows is not None:  # rows known on the host: no sync
        return output.transpose(1, 2).flatten(0, 1)[inputs.query_rows]
    return output.transpose(1, 2)[inputs.query_valid]
