"""Choosing each sequence's next token from its logits, for the whole batch at once, on the device.

The one thing to know: sampling draws no random state. A token is the argmax of
`scores + Gumbel noise` (the Gumbel-max trick, an exact draw from softmax(scores)), and the
noise of vocabulary entry j for a sequence at a position is a hash of (the sequence's
32-bit seed, the position, j). So a sequence gets the same noise whatever else shares its
batch, whichever step or decode window it lands in, and after a preemption (on CPU that is
the same tokens; on a GPU the logits themselves may round differently with the batch size,
which can flip a near tie); and the draw can run inside a captured CUDA graph. `scores` are the logits / temperature with the
top-k / top-p cut applied (-inf outside).

The log-prob returned with a token is log_softmax(raw_logits / temperature) at that token
(`token_log_probs`: the training side computes the same for the same token, verl's convention, and the hf
rollout records it with these functions too), not the log-prob under the truncated distribution.

On CUDA one Triton kernel (`kernels/sample.py`) reads each logits row once for the noise,
the argmax and the log-softmax; elsewhere the same hash runs in PyTorch. A part of the vocabulary (a
tensor-parallel rank's rows) gives partials instead (`vocab_partials`: the best noisy score, its index and
logit, the log-sum-exp's max and sum), and partials of all parts combine into the draw from the whole
(`tokens_from_partials`), as at one rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ember.algorithms.entropy import log_probs_from_logits
from ember.inference.hashing import MASK32, gumbel_noise, mix32_int, row_keys
from ember.inference.request import SamplingParams


def log_prob_temperature(sampling: SamplingParams) -> float:
    """Temperature that scales logits for rollout log-probs: the sampling temperature, or 1 when it is 0."""
    return sampling.temperature if sampling.temperature > 0 else 1.0


def token_log_probs(logits: Tensor, token_ids: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) at token_ids, in float32, computed as the training side does.

    logits: (..., vocab) raw model outputs; token_ids: (...) the chosen tokens. Returns (...).
    """
    return log_probs_from_logits(logits.float() / temperature, token_ids)


def sequence_seed(request_seed: int | None, sequence_id: int) -> int:
    """The 32-bit seed of sample `sequence_id` of a request: derived from `request_seed`, or drawn from torch's RNG."""
    if request_seed is None:
        return int(torch.randint(0, 1 << 31, ()))
    key = (request_seed * 1_000_003 + sequence_id) & MASK32
    return mix32_int(mix32_int(key) ^ ((request_seed >> 32) & MASK32))


def truncated_scores(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """logits / temperature in float32, -inf outside the top-k tokens and the top-p nucleus.

    top_k <= 0 and top_p = 1 turn the respective cut off. Top-k keeps the k largest and every token tied with
    the k-th; top-p then keeps the smallest set of most likely tokens (of those) whose probability reaches
    top_p, and every token tied with the least likely of the set, so the cut never depends on the order of
    equal logits (the most likely token always stays). Both cuts are one threshold on the scaled logits
    (`kept_threshold`).
    """
    scaled = logits.float() / temperature
    if not truncates_vocabulary(top_k, top_p, scaled.shape[-1]):
        return scaled
    return scaled.masked_fill(scaled < kept_threshold(scaled, top_k, top_p), float("-inf"))


def kept_threshold(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """(rows, 1): the least scaled logit the top-k / top-p cut keeps in each row of `scaled` (rows, vocab).

    With a top-k the nucleus lies among the k largest (`topk`, no sort of the vocabulary): their probabilities
    over the kept set (the k, plus any tokens outside them tied with the k-th) give the mass before each of them.
    Without one, the CPU sorts the row (`sorted_nucleus_threshold`) and CUDA searches for the same threshold
    (`kernels/nucleus.py`).
    """
    if 0 < top_k < scaled.shape[-1]:
        candidates = scaled.topk(top_k, dim=-1).values  # descending
        kth = candidates[:, -1:]
        if top_p >= 1:
            return kth
        ties_outside = (scaled == kth).sum(-1, keepdim=True) - (candidates == kth).sum(-1, keepdim=True)
        return _nucleus_among(candidates, ties_outside * (kth - candidates[:, :1]).exp(), top_p)
    if scaled.is_cuda:
        from ember.inference.kernels.nucleus import nucleus_threshold

        return nucleus_threshold(scaled, top_p)
    return sorted_nucleus_threshold(scaled, top_p)


def sorted_nucleus_threshold(scaled: Tensor, top_p: float) -> Tensor:
    """(rows, 1): the top-p cut's least kept scaled logit, by sorting each whole row (the CPU's path)."""
    return _nucleus_among(scaled.sort(dim=-1, descending=True).values, 0.0, top_p)


def _nucleus_among(candidates: Tensor, outside_weight: Tensor | float, top_p: float) -> Tensor:
    """The least of `candidates` (rows, k), descending, whose mass before it is below top_p, the mass over the
    candidates plus `outside_weight` (exp(logit - the row's largest) of kept tokens that are not candidates)."""
    weights = (candidates - candidates[:, :1]).exp()
    total = weights.sum(-1, keepdim=True) + outside_weight
    mass_before = (weights.cumsum(-1) - weights) / total
    kept = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)  # a prefix of the candidates
    return candidates.gather(-1, kept - 1)


def truncates_vocabulary(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether a top-k / top-p cut leaves out any of `vocab_size` tokens' scores (see `truncates`)."""
    return 0 < top_k < vocab_size or top_p < 1


def truncates(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether `sampling` cuts the vocabulary (top-k below its size, or top-p below 1)."""
    return truncates_vocabulary(sampling.top_k, sampling.top_p, vocab_size)


def sample_next_tokens(logits: Tensor, sampling: SamplingParams, seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Next token of each row of `logits` (rows, vocab) and its rollout log-prob; both (rows,).

    seeds: (rows,) each row's sequence seed; positions: (rows,) the position the drawn token
    will take in its sequence. Greedy rows ignore both.
    """
    log_temperature = log_prob_temperature(sampling)
    if logits.is_cuda:
        from ember.inference.kernels.sample import fused_sample

        if sampling.greedy:
            return fused_sample(logits, logits, None, None, 1.0, log_temperature)
        if truncates(sampling, logits.shape[-1]):
            scores = truncated_scores(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            return fused_sample(scores, logits, seeds, positions, 1.0, log_temperature)
        return fused_sample(logits, logits, seeds, positions, 1.0 / sampling.temperature, log_temperature)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        scores = truncated_scores(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tokens = (scores + gumbel_noise(row_keys(seeds, positions), logits.shape[-1])).argmax(dim=-1)
    return tokens, token_log_probs(logits, tokens, log_temperature)


def vocab_partials(logits: Tensor, sampling: SamplingParams, seeds: Tensor, positions: Tensor, first: int,
                   columns: int | None = None) -> Tensor:
    """The untruncated draw's partials over vocabulary entries `first` .. `first + columns - 1`, held by the
    first `columns` columns (default: all) of `logits` (rows, width): (rows, 5, chunks) float32, the fields of
    `kernels.sample.PARTIAL_FIELDS` (one chunk off CUDA). Top-k / top-p need the whole vocabulary: not here."""
    log_temperature = log_prob_temperature(sampling)
    if logits.is_cuda:
        from ember.inference.kernels.sample import sample_partials

        noise = (None, None, 1.0) if sampling.greedy else (seeds, positions, 1.0 / sampling.temperature)
        return sample_partials(logits, logits, *noise, log_temperature, first, columns)
    logits = logits[:, :columns].float()
    if logits.shape[1] == 0:  # a rank of padding rows only (a vocabulary short of the last rank): nothing to draw
        empty = torch.tensor([float("-inf"), first, float("-inf"), 0.0, float("-inf")], device=logits.device)
        return empty.expand(logits.shape[0], 5)[..., None].clone()
    scaled = logits / log_temperature
    scores = logits if sampling.greedy else (
        logits / sampling.temperature + gumbel_noise(row_keys(seeds, positions), logits.shape[-1], first))
    index = scores.argmax(dim=-1, keepdim=True)  # the first of equal ones
    largest = scaled.max(dim=-1, keepdim=True).values
    fields = [scores.gather(-1, index), (index + first).float(), largest, (scaled - largest).exp().sum(-1, keepdim=True),
              scaled.gather(-1, index)]
    return torch.stack(fields, dim=1)


def tokens_from_partials(partials: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, log-probs), both (rows,), from partials (rows, 5, chunks) of the whole vocabulary in its order
    (`vocab_partials` of its parts, side by side): the best chunk's entry (the earliest of equal ones), and its
    scaled logit minus the log-sum-exp of all."""
    if partials.is_cuda:
        from ember.inference.kernels.sample import combine_partials

        return combine_partials(partials)
    best, index, maxes, sums, chosen = partials.unbind(1)
    winner = best.argmax(dim=-1, keepdim=True)
    largest = maxes.max(dim=-1, keepdim=True).values
    total = (sums * (maxes - largest).exp()).sum(-1)
    return index.gather(-1, winner)[:, 0].long(), chosen.gather(-1, winner)[:, 0] - largest[:, 0] - total.log()
