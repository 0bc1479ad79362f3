"""The top-p (nucleus) cut of each row without sorting the vocabulary.

The nucleus keeps a scaled logit x when the probability of the entries strictly above it is below top_p, so every
entry tied with the least kept one stays (`sampling.kept_threshold`'s rule, which sorts the row). Sorting 512 rows
of a 152k vocabulary took four times an untruncated decode step on an H200; here the least kept value is searched
for instead. float32 values map one to one and in order onto the integers 0 .. 2**32 - 1 (the kernel's `key`); the
search finds K*, the least key whose mass above is below top_p, and keeps the entries with keys from K* up. Eight
passes over the row each fix four bits of K*: a program per (row, chunk of the vocabulary) sums exp(x - row max)
over the entries above the end of each of the 16 equal parts of the row's current key interval; the chunks' sums
are added up in a fixed order (the result does not depend on the batch or on atomics), and each row steps into the
first part whose end has less than top_p of the mass above it. (-0.0 has a key of its own, just below +0.0's; the cut then
compares floats, which keeps both zeros or neither, as the tie rule does.)

The mass here is summed in another order than the sorted row's running sum, so a row whose cut falls within
float rounding of top_p may keep one entry more or less than the sorting path would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_VOCAB = 512
CHUNK_VOCAB = 16 * BLOCK_VOCAB
NUM_WARPS = 4  # 2.62 ms against 8 warps' 2.95 at 512 rows on an H200 (BENCHMARKS.md)
PARTS = 16  # parts of the key interval a pass tells apart: four bits of K* a pass
KEY_BITS = 32
SIGN = 1 << 31
NEGATIVE_INFINITY_KEY = SIGN - 1 - 0x7F800000  # the least key a value takes: -inf's


@triton.jit
def _interval_mass_kernel(scaled_ptr, row_max_ptr, low_ptr, above_ptr, total_ptr, columns, stride, chunks, shift,
                          FIRST: tl.constexpr, SIGN: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                          CHUNK: tl.constexpr):
    """One (row, chunk): for each part j of the row's interval [low, low + PARTS << shift), the sum of
    exp(x - row max) over the chunk's entries whose keys lie above the part's last key, as (rows, chunks, PARTS);
    in the first pass also the chunk's whole sum (rows, chunks)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    low = tl.load(low_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    part_ids = tl.arange(0, PARTS)
    part_ends = low + ((part_ids.to(tl.int64) + 1) << shift) - 1
    above = tl.zeros([PARTS, BLOCK], dtype=tl.float32)  # summed across the chunk's blocks, reduced once at its end
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        index = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        values = tl.load(scaled_ptr + row * stride + index, mask=index < columns, other=-float("inf"))
        bits = values.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(bits >= 0, bits + SIGN, SIGN - 1 - (bits & (SIGN - 1)))
        weight = tl.exp(values - row_max)  # 0 outside the vocabulary (-inf)
        above += tl.where(key[None, :] > part_ends[:, None], weight[None, :], 0.0)
        if FIRST:
            total += weight
    slot = row * chunks + chunk
    tl.store(above_ptr + slot * PARTS + part_ids, tl.sum(above, axis=1))
    if FIRST:
        tl.store(total_ptr + slot, tl.sum(total, axis=0))


@triton.jit
def _step_kernel(above_ptr, total_ptr, low_ptr, limit_ptr, chunks, shift, top_p, FIRST: tl.constexpr,
                 PARTS: tl.constexpr, CHUNKS: tl.constexpr):
    """One row: its chunks' sums added up (in a fixed order), and its interval narrowed to the first part whose end
    has less than top_p of the row's mass above it (the last part's end always has: the search keeps it so)."""
    row = tl.program_id(0).to(tl.int64)
    chunk_ids = tl.arange(0, CHUNKS)
    part_ids = tl.arange(0, PARTS)
    inside = chunk_ids < chunks
    if FIRST:
        limit = top_p * tl.sum(tl.load(total_ptr + row * chunks + chunk_ids, mask=inside, other=0.0), axis=0)
        tl.store(limit_ptr + row, limit)
    else:
        limit = tl.load(limit_ptr + row)
    sums = tl.load(above_ptr + (row * chunks + chunk_ids[:, None]) * PARTS + part_ids[None, :], mask=inside[:, None],
                   other=0.0)
    above_end = tl.sum(sums, axis=0)
    step = tl.sum(((above_end >= limit) & (part_ids < PARTS - 1)).to(tl.int64), axis=0)
    tl.store(low_ptr + row, tl.load(low_ptr + row) + (step << shift))


def nucleus_threshold(scaled: Tensor, top_p: float) -> Tensor:
    """(rows, 1): the least scaled logit the top-p cut keeps in each row of `scaled` (rows, vocab) float32 on the
    device (entries below it are cut; -inf where the cut keeps every entry). Seventeen launches, no sync."""
    scaled = scaled.contiguous()
    rows, columns = scaled.shape
    chunks = triton.cdiv(columns, CHUNK_VOCAB)
    row_max = scaled.max(dim=-1).values
    if rows == 0:
        return row_max[:, None]
    low = torch.zeros(rows, dtype=torch.int64, device=scaled.device)
    limit = torch.empty(rows, dtype=torch.float32, device=scaled.device)
    above = torch.empty(rows, chunks, PARTS, dtype=torch.float32, device=scaled.device)
    total = torch.empty(rows, chunks, dtype=torch.float32, device=scaled.device)
    for shift in range(KEY_BITS - 4, -1, -4):
        first = shift == KEY_BITS - 4
        _interval_mass_kernel[(rows, chunks)](scaled, row_max, low, above, total, columns, scaled.stride(0), chunks,
                                              shift, FIRST=first, SIGN=SIGN, PARTS=PARTS, BLOCK=BLOCK_VOCAB,
                                              CHUNK=CHUNK_VOCAB, num_warps=NUM_WARPS)
        _step_kernel[(rows,)](above, total, low, limit, chunks, shift, float(top_p), FIRST=first, PARTS=PARTS,
                              CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return float_of_key(low.clamp(min=NEGATIVE_INFINITY_KEY))[:, None]


def float_of_key(key: Tensor) -> Tensor:
    """The float32 values of ordered keys (int64 in 0 .. 2**32 - 1): the inverse of the kernel's key."""
    bits = torch.where(key >= SIGN, key - SIGN, (SIGN - 1 - key) - SIGN)  # as int32: a set sign bit is negative
    return bits.to(torch.int32).view(torch.float32)
