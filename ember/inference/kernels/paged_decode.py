"""Decode attention over the paged KV cache: one new query token per sequence, its blocks read in place.

One program per (sequence, KV head) computes all query heads of that KV head's group at
once (grouped-query attention: the group is padded to 16 rows for the matrix units). It
walks the sequence's context in tiles of TILE tokens, looking each token's block up in the
block table, with an online softmax, so only valid blocks are read and nothing is gathered
or padded in memory. A sliding window starts the walk at the window's first token.

It must equal `attention.gathered_attention` for decode steps (tests/gpu compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE = 64


@triton.jit
def _paged_decode_kernel(
    queries_ptr, key_cache_ptr, value_cache_ptr, output_ptr, block_tables_ptr, context_lengths_ptr,
    scale, window,
    query_token_stride, query_head_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
    block_table_stride, output_token_stride, output_head_stride,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr, HAS_WINDOW: tl.constexpr, EXACT_DOT: tl.constexpr,
):
    sequence = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    context = tl.load(context_lengths_ptr + sequence).to(tl.int64)
    rows = tl.arange(0, GROUP_ROWS)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    queries = tl.load(
        queries_ptr + sequence * query_token_stride + heads[:, None] * query_head_stride + dims[None, :],
        mask=row_valid[:, None], other=0.0,
    )
    running_max = tl.full([GROUP_ROWS], -float("inf"), tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], tl.float32)
    accumulated = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context - window, 0)
    start = (first // TILE_TOKENS) * TILE_TOKENS
    for tile_start in range(start, context, TILE_TOKENS):
        tokens = tile_start + tl.arange(0, TILE_TOKENS)
        valid = (tokens < context) & (tokens >= first)
        blocks = tl.load(block_tables_ptr + sequence * block_table_stride + tokens // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * cache_block_stride + (tokens % BLOCK_SIZE) * cache_slot_stride
        offsets = slots[:, None] + kv_head * cache_head_stride + dims[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        if EXACT_DOT:
            scores = tl.dot(queries, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(queries, tl.trans(keys))
        scores = tl.where(valid[None, :], scores * scale, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        values = tl.load(value_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        if EXACT_DOT:
            accumulated = accumulated * correction[:, None] + tl.dot(weights.to(values.dtype), values, input_precision="ieee")
        else:
            accumulated = accumulated * correction[:, None] + tl.dot(weights.to(values.dtype), values)
        running_max = new_max
    result = accumulated / running_sum[:, None]
    tl.store(
        output_ptr + sequence * output_token_stride + heads[:, None] * output_head_stride + dims[None, :],
        result.to(output_ptr.dtype.element_ty), mask=row_valid[:, None],
    )


def paged_decode_attention(
    queries: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    context_lengths: Tensor,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """Attention of one query per sequence over its cached context.

    queries: (sequences, heads, head_dim); caches: (blocks, block_size, kv_heads, head_dim);
    block_tables: (sequences, most blocks); context_lengths: (sequences,) tokens to attend
    to, the new one included (already written). Returns (sequences, heads, head_dim) in the
    cache's dtype.
    """
    sequences, num_heads, head_dim = queries.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    queries = queries.to(key_cache.dtype).contiguous()
    output = torch.empty_like(queries)
    _paged_decode_kernel[(sequences, num_kv_heads)](
        queries, key_cache, value_cache, output, block_tables, context_lengths,
        scale, sliding_window or 0,
        queries.stride(0), queries.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), output.stride(0), output.stride(1),
        GROUP=group, GROUP_ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_TOKENS=TILE, HAS_WINDOW=sliding_window is not None, EXACT_DOT=key_cache.dtype == torch.float32,
        num_warps=4,
    )
    return output
