"""The counter-based hash behind ember's sampling noise: a pure function of (seed, position, vocabulary index).

`row_keys` mixes a sequence's 32-bit seed with the position of the token being drawn;
`gumbel_noise` turns (row key, vocabulary index) into Gumbel(0, 1) noise. The arithmetic
is 32-bit (xorshift-multiply rounds) done in int64 with 16-bit split multiplications, so
nothing overflows; the Triton sampling kernel (`kernels/sample.py`) repeats it exactly
with the same constants.

The one thing to know about the noise: its large values are what let unlikely tokens win,
so the transform keeps the hash's 32 bits where they matter, near the top. The noise is
-log(-log(u)) with u = (hash + 0.5) / 2**32, computed as -log(-log1p(-w)) from w = 1 - u,
which float32 holds to full precision where it is small (the large noise), and w stays
below 1, so no noise is infinite. (-log(-log(u)) on a 24-bit u in float32 rounded u to
exactly 1 for one hash in 2**24: infinite noise, which picked a token whatever its
probability, in 0.3% of rows at a 49k vocabulary.)
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1
"""Multiplier spreading vocabulary indices over 32 bits before hashing."""
MIX_MULTIPLIERS = (0x21F0AAAD, 0xD35A2D97)
"""The two rounds' odd multipliers of `mix32` (the Triton kernel uses the same)."""
LARGEST_BELOW_ONE = 1.0 - 2.0**-24
"""The largest float32 below 1: the bound on w, which keeps -log1p(-w) finite."""


def mix32(values: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds), elementwise on int64 tensors holding uint32 values."""
    values = values ^ (values >> 16)
    values = _mul32(values, MIX_MULTIPLIERS[0])
    values = values ^ (values >> 15)
    values = _mul32(values, MIX_MULTIPLIERS[1])
    return values ^ (values >> 15)


def mix32_int(value: int) -> int:
    """`mix32` of one uint32 held in a Python int (the host's per-sequence seeds: no tensor ops)."""
    value ^= value >> 16
    value = (value * MIX_MULTIPLIERS[0]) & MASK32
    value ^= value >> 15
    value = (value * MIX_MULTIPLIERS[1]) & MASK32
    return value ^ (value >> 15)


def _mul32(values: Tensor, constant: int) -> Tensor:
    """(values * constant) mod 2**32 without int64 overflow: the constant is split in 16-bit halves."""
    low = values * (constant & 0xFFFF)
    high = ((values * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """One 32-bit key per row: the hash of its sequence's seed and the position of the token being drawn."""
    return mix32((seeds.long() & MASK32) ^ mix32(positions.long() & MASK32))


def gumbel_noise(keys: Tensor, vocab_size: int, first: int = 0) -> Tensor:
    """(rows, vocab_size) float32 Gumbel(0, 1) noise, a pure function of each row's key and the vocabulary index
    (entries `first` .. `first + vocab_size - 1`: a tensor-parallel rank's rows of the vocabulary)."""
    spread = _mul32(torch.arange(first, first + vocab_size, device=keys.device, dtype=torch.long), GOLDEN32)
    return gumbel_from_hashes(mix32(keys[:, None] ^ spread[None, :]))


def gumbel_from_hashes(hashes: Tensor) -> Tensor:
    """Gumbel(0, 1) noise in float32 from uint32 hashes (held in int64): -log(-log u), u = (hash + 0.5) / 2**32.

    Computed through w = 1 - u = (complement + 0.5) / 2**32, full float32 precision where it
    is small: the noise rises with the hash, to 22.9 at the largest; w stays below 1, so the
    smallest is -2.8.
    """
    complement = ((hashes ^ MASK32).float() + 0.5) * 2.0**-32
    return -torch.log(-torch.log1p(-complement.clamp_max(LARGEST_BELOW_ONE)))
