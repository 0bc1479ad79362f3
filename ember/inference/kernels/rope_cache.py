"""RoPE for one step's queries and keys, and the keys and values written to the paged cache, in one kernel.

One program per token loads its position's cos/sin rows once, rotates every query head
into a fresh output and every key head straight into the token's cache slot, and copies
its value heads there too: the three kernels of the reference (compiled rotation, two
index copies) become one, and the rotated keys never make a round trip through memory.
The rotation is HF's "rotate half" in float32, rounded to the output's dtype.

It must equal `RotaryEmbedding.__call__` + `attention.write_kv_cache` (tests/gpu compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(in_ptr, in_rows, out_ptr, out_rows, valid, half, cos_low, cos_high, sin_low, sin_high,
                  HALF: tl.constexpr):
    """Rotate the heads at in_ptr + in_rows (each 2 * HALF contiguous dims), store them at out_ptr + out_rows."""
    low = tl.load(in_ptr + in_rows[:, None] + half[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    high = tl.load(in_ptr + in_rows[:, None] + HALF + half[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    out_low = low * cos_low[None, :] + (-high) * sin_low[None, :]
    out_high = high * cos_high[None, :] + low * sin_high[None, :]
    out_type = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_rows[:, None] + half[None, :], out_low.to(out_type), mask=valid[:, None])
    tl.store(out_ptr + out_rows[:, None] + HALF + half[None, :], out_high.to(out_type), mask=valid[:, None])


@triton.jit
def _rope_cache_kernel(
    queries_ptr, keys_ptr, values_ptr, output_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
    key_cache_ptr, value_cache_ptr,
    query_token_stride, query_head_stride, key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    output_token_stride, output_head_stride, table_stride, cache_slot_stride, cache_head_stride,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_ROWS: tl.constexpr, KV_HEAD_ROWS: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    half = tl.arange(0, HALF)
    table_row = position * table_stride
    cos_low, cos_high = tl.load(cos_ptr + table_row + half), tl.load(cos_ptr + table_row + HALF + half)
    sin_low, sin_high = tl.load(sin_ptr + table_row + half), tl.load(sin_ptr + table_row + HALF + half)

    heads = tl.arange(0, HEAD_ROWS)
    _rotate_heads(queries_ptr + token * query_token_stride, heads * query_head_stride,
                  output_ptr + token * output_token_stride, heads * output_head_stride, heads < HEADS,
                  half, cos_low, cos_high, sin_low, sin_high, HALF)
    kv_heads = tl.arange(0, KV_HEAD_ROWS)
    kv_valid = kv_heads < KV_HEADS
    cache_rows = slot * cache_slot_stride + kv_heads * cache_head_stride
    _rotate_heads(keys_ptr + token * key_token_stride, kv_heads * key_head_stride, key_cache_ptr, cache_rows,
                  kv_valid, half, cos_low, cos_high, sin_low, sin_high, HALF)
    dims = tl.arange(0, 2 * HALF)
    values = tl.load(values_ptr + token * value_token_stride + kv_heads[:, None] * value_head_stride + dims[None, :],
                     mask=kv_valid[:, None], other=0.0)
    tl.store(value_cache_ptr + cache_rows[:, None] + dims[None, :], values.to(value_cache_ptr.dtype.element_ty),
             mask=kv_valid[:, None])


def rope_and_cache(
    queries: Tensor, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
    key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
) -> Tensor:
    """Rotated queries (tokens, heads, head_dim); keys rotated and values written to `slot_mapping`'s slots.

    queries (tokens, heads, head_dim) and keys/values (tokens, kv_heads, head_dim) may be strided
    views (of one fused q/k/v projection); each head's dims must be contiguous. cos/sin: (positions,
    head_dim) float32; caches: (blocks, block_size, kv_heads, head_dim), contiguous.
    """
    tokens, heads, head_dim = queries.shape
    kv_heads = keys.shape[1]
    for tensor in (queries, keys, values):
        if tensor.stride(-1) != 1:
            raise ValueError("rope_and_cache needs each head's dims contiguous (stride 1 along head_dim)")
    if keys.dtype != key_cache.dtype:  # the reference rounds rotated keys to the model's dtype, then the cache's
        raise ValueError(f"rope_and_cache writes keys of dtype {keys.dtype} to a cache of {key_cache.dtype}: they must match")
    output = torch.empty(tokens, heads, head_dim, dtype=queries.dtype, device=queries.device)
    if tokens == 0:
        return output
    flat_keys, flat_values = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)
    _rope_cache_kernel[(tokens,)](
        queries, keys, values, output, cos, sin, positions, slot_mapping, flat_keys, flat_values,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        output.stride(0), output.stride(1), cos.stride(0), flat_keys.stride(0), flat_keys.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_ROWS=triton.next_power_of_2(heads),
        KV_HEAD_ROWS=triton.next_power_of_2(kv_heads), HALF=head_dim // 2,
    )
    return output
