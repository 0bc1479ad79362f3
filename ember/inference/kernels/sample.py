"""One pass over each logits row: hashed Gumbel noise, the argmax and the log-softmax at the chosen token.

The noise is the very hash and transform of `ember.inference.hashing` (`row_keys`,
`gumbel_noise`), here in native uint32 arithmetic (products wrap modulo 2**32, which the
PyTorch reference computes with split multiplications), so the CUDA path and the PyTorch
path draw the same tokens up to float rounding of the logits and of log / log1p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from ember.inference.hashing import GOLDEN32, LARGEST_BELOW_ONE, MIX_MULTIPLIERS

BLOCK_VOCAB = 4096


@triton.jit
def _mix32(values, first: tl.constexpr, second: tl.constexpr):
    """hashing.mix32 on uint32 values: their products wrap modulo 2**32 as the reference computes."""
    values = values ^ (values >> 16)
    values = values * tl.full(values.shape, first, tl.uint32)
    values = values ^ (values >> 15)
    values = values * tl.full(values.shape, second, tl.uint32)
    return values ^ (values >> 15)


@triton.jit
def _sample_kernel(
    scores_ptr, logits_ptr, seeds_ptr, positions_ptr, tokens_ptr, log_probs_ptr,
    vocab_size, scores_stride, logits_stride, score_scale, inverse_log_temperature,
    ADD_NOISE: tl.constexpr, GOLDEN: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr,
    COMPLEMENT_BOUND: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    best = -float("inf")
    best_index = 0
    running_max = -float("inf")
    running_sum = 0.0
    if ADD_NOISE:
        # hashing.row_keys: the hash of the row's seed and the position of the token drawn
        seed = tl.load(seeds_ptr + row).to(tl.uint32)  # the low 32 bits, as hashing.row_keys masks them
        position = tl.load(positions_ptr + row).to(tl.uint32)
        key = _mix32(seed ^ _mix32(position, FIRST, SECOND), FIRST, SECOND)
    for start in range(0, vocab_size, BLOCK):
        index = start + tl.arange(0, BLOCK)
        inside = index < vocab_size
        scores = tl.load(scores_ptr + row * scores_stride + index, mask=inside, other=-float("inf")).to(tl.float32)
        scores = scores * score_scale
        if ADD_NOISE:
            spread = index.to(tl.uint32) * tl.full(index.shape, GOLDEN, tl.uint32)
            hashed = _mix32(key ^ spread, FIRST, SECOND)
            # hashing.gumbel_from_hashes: -log(-log u) through 1 - u, exact where it is small (large noise)
            complement = tl.minimum(((~hashed).to(tl.float32) + 0.5) * (1.0 / 4294967296.0), COMPLEMENT_BOUND)
            scores = scores - tl.log(-libdevice.log1p(-complement))
        scores = tl.where(inside, scores, -float("inf"))
        tile_best = tl.max(scores, axis=0)
        tile_index = tl.argmax(scores, axis=0)
        better = tile_best > best
        best_index = tl.where(better, start + tile_index, best_index)
        best = tl.where(better, tile_best, best)
        logits = tl.load(logits_ptr + row * logits_stride + index, mask=inside, other=-float("inf")).to(tl.float32)
        logits = logits * inverse_log_temperature
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    chosen = tl.load(logits_ptr + row * logits_stride + best_index).to(tl.float32) * inverse_log_temperature
    tl.store(tokens_ptr + row, best_index.to(tl.int64))
    tl.store(log_probs_ptr + row, chosen - running_max - tl.log(running_sum))


def fused_sample(
    scores: Tensor, logits: Tensor, seeds: Tensor | None, positions: Tensor | None, score_scale: float,
    log_temperature: float,
) -> tuple[Tensor, Tensor]:
    """argmax(scores * score_scale + noise) per row, and log_softmax(logits / log_temperature) there.

    scores, logits: (rows, vocab), any float dtype (may be the same tensor); seeds,
    positions: (rows,) each row's sequence seed and the drawn token's position, which fix
    its noise (`sampling.gumbel_noise`), or None for no noise (greedy). Returns (tokens
    int64, log-probs float32), both (rows,).
    """
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, log_probs
    scores, logits = scores.contiguous(), logits.contiguous()
    _sample_kernel[(rows,)](
        scores, logits, seeds if seeds is not None else tokens, positions if positions is not None else tokens,
        tokens, log_probs,
        vocab_size, scores.stride(0), logits.stride(0), float(score_scale), 1.0 / log_temperature,
        ADD_NOISE=seeds is not None, GOLDEN=GOLDEN32, FIRST=MIX_MULTIPLIERS[0], SECOND=MIX_MULTIPLIERS[1],
        COMPLEMENT_BOUND=LARGEST_BELOW_ONE, BLOCK=BLOCK_VOCAB, num_warps=8,
    )
    return tokens, log_probs
