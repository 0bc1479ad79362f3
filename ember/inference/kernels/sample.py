"""One pass over each logits row: hashed Gumbel noise, the argmax and the log-softmax at the chosen token.

The pass is split over chunks of the vocabulary (a program per row and chunk, then one small program
per row that combines the chunks' best tokens and log-sum-exps): one program per row left most of
an H100 idle at 64 rows of a 152k vocabulary (112 µs; 43 µs split). At 512 rows it is bound by the
arithmetic per entry (the hash, two logarithms and an exp): the Gumbel transform's logarithms are the
hardware's fast one, and its inner log1p a short series where the noise is large (512 rows: 326 → 191 µs;
64 rows: 41 → 27 µs, on an H100).

Under rollout tensor parallelism each rank runs the chunk pass over its own rows of the vocabulary
(`sample_partials` with their offset) and the ranks all-gather the chunks' partials, a few numbers a
chunk, instead of the logits (`models/vocab_parallel.py`); the combine is the same.

The noise is the very hash and transform of `ember.inference.hashing` (`row_keys`,
`gumbel_noise`), here in native uint32 arithmetic (products wrap modulo 2**32, which the
PyTorch reference computes with split multiplications), so the CUDA path and the PyTorch
path draw the same tokens up to float rounding of the logits and of the noise (here within 2e-6 of the
reference's: a near-tie closer than that may fall the other way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from ember.inference.hashing import GOLDEN32, LARGEST_BELOW_ONE, MIX_MULTIPLIERS

BLOCK_VOCAB = 4096
CHUNK_VOCAB = 2 * BLOCK_VOCAB  # vocabulary entries per program (152k: 19 programs per row)
PARTIAL_FIELDS = ("best noisy score", "its vocabulary index", "max scaled logit", "sum of exp(scaled logit - max)",
                  "the best entry's scaled logit")


@triton.jit
def _mix32(values, first: tl.constexpr, second: tl.constexpr):
    """hashing.mix32 on uint32 values: their products wrap modulo 2**32 as the reference computes."""
    values = values ^ (values >> 16)
    values = values * tl.full(values.shape, first, tl.uint32)
    values = values ^ (values >> 15)
    values = values * tl.full(values.shape, second, tl.uint32)
    return values ^ (values >> 15)


@triton.jit
def _minus_log1p_minus(c):
    """-log(1 - c) for c in (0, 1): its series below 1/16 (exact to float rounding where the Gumbel noise is
    large), the fast hardware logarithm of 1 - c above (absolute error about 1e-7: noise off by under 2e-6)."""
    series = c * (1.0 + c * (1.0 / 2 + c * (1.0 / 3 + c * (1.0 / 4 + c * (1.0 / 5 + c * (1.0 / 6 + c * (1.0 / 7)))))))
    return tl.where(c < 0.0625, series, -libdevice.fast_logf(1.0 - c))


@triton.jit
def _sample_chunk_kernel(
    scores_ptr, logits_ptr, seeds_ptr, positions_ptr, partials_ptr,
    columns, vocab_offset, chunks, scores_stride, logits_stride, score_scale, inverse_log_temperature,
    ADD_NOISE: tl.constexpr, KEEP_CHOSEN: tl.constexpr, GOLDEN: tl.constexpr, FIRST: tl.constexpr,
    SECOND: tl.constexpr, COMPLEMENT_BOUND: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (row, chunk of the `columns` vocabulary entries, the first of them entry `vocab_offset`): the best noisy
    score there, its vocabulary index and (with KEEP_CHOSEN) its scaled logit, and the chunk's log-sum-exp of the
    scaled logits as (max, sum of exp(logit - max)): the `PARTIAL_FIELDS` of the row's `partials`."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    first = chunk * CHUNK
    best = -float("inf")
    best_index = first
    chosen = -float("inf")
    running_max = -float("inf")
    running_sum = 0.0
    if ADD_NOISE:
        # hashing.row_keys: the hash of the row's seed and the position of the token drawn
        seed = tl.load(seeds_ptr + row).to(tl.uint32)  # the low 32 bits, as hashing.row_keys masks them
        position = tl.load(positions_ptr + row).to(tl.uint32)
        key = _mix32(seed ^ _mix32(position, FIRST, SECOND), FIRST, SECOND)
    for offset in range(0, CHUNK, BLOCK):
        start = first + offset
        index = start + tl.arange(0, BLOCK)
        inside = index < columns
        scores = tl.load(scores_ptr + row * scores_stride + index, mask=inside, other=-float("inf")).to(tl.float32)
        scores = scores * score_scale
        if ADD_NOISE:
            spread = (index + vocab_offset).to(tl.uint32) * tl.full(index.shape, GOLDEN, tl.uint32)
            hashed = _mix32(key ^ spread, FIRST, SECOND)
            # hashing.gumbel_from_hashes: -log(-log u) through 1 - u, exact where it is small (large noise); the
            # bitwise complement is an xor (the same instructions as ~, which Triton's interpreter cannot run)
            flipped = hashed ^ 0xFFFFFFFF
            complement = tl.minimum((flipped.to(tl.float32) + 0.5) * (1.0 / 4294967296.0), COMPLEMENT_BOUND)
            scores = scores - libdevice.fast_logf(_minus_log1p_minus(complement))
        scores = tl.where(inside, scores, -float("inf"))
        logits = tl.load(logits_ptr + row * logits_stride + index, mask=inside, other=-float("inf")).to(tl.float32)
        logits = logits * inverse_log_temperature
        tile_best = tl.max(scores, axis=0)
        tile_index = tl.argmax(scores, axis=0)
        better = tile_best > best  # ties keep the earlier index, as one pass over the row would
        if KEEP_CHOSEN:  # one more reduction a tile: only where the combine cannot read the logits
            tile_chosen = tl.sum(tl.where(tl.arange(0, BLOCK) == tile_index, logits, 0.0), axis=0)
            chosen = tl.where(better, tile_chosen, chosen)
        best_index = tl.where(better, start + tile_index, best_index)
        best = tl.where(better, tile_best, best)
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        # a tile past the rank's last vocabulary row (the last rank's padding) has no entry: -inf - -inf is NaN
        running_sum = tl.where(new_max == -float("inf"), 0.0,
                               running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0))
        running_max = new_max
    slot = row * 5 * chunks + chunk
    tl.store(partials_ptr + slot, best)
    tl.store(partials_ptr + slot + chunks, (best_index + vocab_offset).to(tl.float32))
    tl.store(partials_ptr + slot + 2 * chunks, running_max)
    tl.store(partials_ptr + slot + 3 * chunks, running_sum)
    tl.store(partials_ptr + slot + 4 * chunks, chosen)


@triton.jit
def _sample_combine_kernel(partials_ptr, logits_ptr, tokens_ptr, log_probs_ptr, chunks, logits_stride,
                           inverse_log_temperature, CHOSEN_FROM_LOGITS: tl.constexpr, CHUNKS: tl.constexpr):
    """One row: the token of its best chunk (the earliest of equal ones) and log_softmax at that token from
    the chunks' log-sum-exps; the token's scaled logit from the partials, or read from the logits."""
    row = tl.program_id(0).to(tl.int64)
    which = tl.arange(0, CHUNKS)
    inside = which < chunks
    base = partials_ptr + row * 5 * chunks
    bests = tl.load(base + which, mask=inside, other=-float("inf"))
    top = tl.max(bests, axis=0)
    winner = tl.min(tl.where(bests == top, which, CHUNKS), axis=0)
    token = tl.load(base + chunks + winner).to(tl.int64)
    maxes = tl.load(base + 2 * chunks + which, mask=inside, other=-float("inf"))
    largest = tl.max(maxes, axis=0)
    sums = tl.load(base + 3 * chunks + which, mask=inside, other=0.0)
    total = tl.sum(tl.where(inside, sums * tl.exp(maxes - largest), 0.0), axis=0)
    if CHOSEN_FROM_LOGITS:
        chosen = tl.load(logits_ptr + row * logits_stride + token).to(tl.float32) * inverse_log_temperature
    else:
        chosen = tl.load(base + 4 * chunks + winner)
    tl.store(tokens_ptr + row, token)
    tl.store(log_probs_ptr + row, chosen - largest - tl.log(total))


def sample_partials(
    scores: Tensor, logits: Tensor, seeds: Tensor | None, positions: Tensor | None, score_scale: float,
    log_temperature: float, vocab_offset: int = 0, columns: int | None = None, keep_chosen: bool = True,
) -> Tensor:
    """Each row's partials over the vocabulary entries `vocab_offset` .. `vocab_offset + columns - 1` that the
    first `columns` columns (default: all) of `scores` and `logits` (rows, width) hold: (rows, 5, chunks) float32,
    the `PARTIAL_FIELDS` of each chunk of CHUNK_VOCAB columns (chunks cover the whole width, so equal widths give
    equal shapes). Partials of several parts of the vocabulary, side by side along the last dimension in
    vocabulary order, combine (`combine_partials`) into the draw from the whole. Without `keep_chosen` the chosen
    entry's logit is left out (the combine then reads it from the logits)."""
    rows, width = logits.shape
    columns = width if columns is None else columns
    scores, logits = scores.contiguous(), logits.contiguous()
    chunks = triton.cdiv(width, CHUNK_VOCAB)
    partials = torch.empty(rows, 5, chunks, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return partials
    dummy = partials  # seeds and positions are not read without noise
    _sample_chunk_kernel[(rows, chunks)](
        scores, logits, seeds if seeds is not None else dummy, positions if positions is not None else dummy,
        partials, columns, vocab_offset, chunks, scores.stride(0), logits.stride(0), float(score_scale),
        1.0 / log_temperature,
        ADD_NOISE=seeds is not None, KEEP_CHOSEN=keep_chosen, GOLDEN=GOLDEN32, FIRST=MIX_MULTIPLIERS[0], SECOND=MIX_MULTIPLIERS[1],
        COMPLEMENT_BOUND=LARGEST_BELOW_ONE, BLOCK=BLOCK_VOCAB, CHUNK=CHUNK_VOCAB, num_warps=8,
    )
    return partials


def combine_partials(partials: Tensor, logits: Tensor | None = None, log_temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(tokens int64, log-probs float32), both (rows,), from (rows, 5, chunks) partials (`sample_partials`); the
    chosen token's logit from the partials, or from the whole `logits` (scaled by 1 / log_temperature) if given."""
    rows, _, chunks = partials.shape
    partials = partials.contiguous()
    tokens = torch.empty(rows, dtype=torch.long, device=partials.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=partials.device)
    if rows:
        from_logits = logits is not None
        logits = logits.contiguous() if from_logits else partials
        _sample_combine_kernel[(rows,)](partials, logits, tokens, log_probs, chunks, logits.stride(0),
                                        1.0 / log_temperature, CHOSEN_FROM_LOGITS=from_logits,
                                        CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return tokens, log_probs


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
    partials = sample_partials(scores, logits, seeds, positions, score_scale, log_temperature, keep_chosen=False)
    return combine_partials(partials, logits, log_temperature)
