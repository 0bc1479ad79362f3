"""Engine sampling draws from the distribution it claims: the hashed Gumbel-max against exact
expectations at a real vocabulary size, temperatures below and at 1, with and without top-k /
top-p; token frequencies at a small vocabulary; and the noise transform's tail.

The draws of a configuration are the argmax of its scores plus each row's hashed noise (what
`sample_next_tokens` computes on CPU: checked below); the noise of all draws is made once
and shared by the configurations. Seeds are fixed, so every check is deterministic; the
limits sit where a correct sampler passes by a wide margin (|z| < 4).
"""

import math

import pytest
import torch

from ember.inference.hashing import gumbel_from_hashes, gumbel_noise, row_keys
from ember.inference.sampling import sample_next_tokens, sequence_seed, truncated_scores
from ember.rollout.base import SamplingParams

VOCAB = 49_152
DRAWS = 1024
CHUNK = 16  # rows of noise at a time: small blocks stay in cache
Z_LIMIT = 4.0
CONFIGS = [(temperature, top_k, top_p) for temperature in (0.3, 0.6, 1.0) for top_k, top_p in ((-1, 1.0), (50, 1.0), (-1, 0.9))]


def logits_row(vocab_size: int, seed: int) -> torch.Tensor:
    """One row of logits ~ N(0, 3²): a spread like a language model's, most tokens very unlikely below temperature 1."""
    return torch.randn(1, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def draw_keys(draws: int, position: int) -> torch.Tensor:
    """Row keys of `draws` sequences of one request (seed 7) at one position."""
    seeds = torch.tensor([sequence_seed(7, sequence_id) for sequence_id in range(draws)])
    return row_keys(seeds, torch.full((draws,), position))


@pytest.fixture(scope="module")
def large_vocabulary_draws() -> tuple[torch.Tensor, dict[tuple, torch.Tensor]]:
    """The logits row and, for each configuration, the tokens of DRAWS draws from it.

    The row's top tokens are close (seed 1), so even at T = 0.3 the draws spread over several.
    """
    logits = logits_row(VOCAB, seed=1)
    scores = {config: truncated_scores(logits, *config) for config in CONFIGS}
    keys = draw_keys(DRAWS, position=37)
    tokens = {config: [] for config in CONFIGS}
    for start in range(0, DRAWS, CHUNK):
        noise = gumbel_noise(keys[start:start + CHUNK], VOCAB)
        for config in CONFIGS:
            tokens[config].append((scores[config] + noise).argmax(dim=-1))
    return logits, {config: torch.cat(chunks) for config, chunks in tokens.items()}


def test_cpu_sampling_is_the_argmax_of_truncated_scores_plus_hashed_noise():
    logits = logits_row(2000, seed=1).expand(16, -1)
    seeds = torch.tensor([sequence_seed(3, sequence_id) for sequence_id in range(16)])
    positions = torch.arange(16)
    noise = gumbel_noise(row_keys(seeds, positions), 2000)
    for temperature, top_k, top_p in [(0.6, -1, 1.0), (0.6, 50, 1.0), (1.0, -1, 0.9)]:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        tokens, _ = sample_next_tokens(logits, sampling, seeds, positions)
        expected = (truncated_scores(logits, temperature, top_k, top_p) + noise).argmax(dim=-1)
        assert torch.equal(tokens, expected)


def far_tail_level(log_probs: torch.Tensor, mass: float) -> float:
    """The log-prob below which the tokens together hold at most `mass` of the probability."""
    ordered = log_probs.sort().values
    return float(ordered[int((ordered.exp().cumsum(dim=0) <= mass).sum())])


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[f"T{t}-k{k}-p{p}" for t, k, p in CONFIGS])
def test_draws_at_a_real_vocabulary_follow_the_exact_distribution(large_vocabulary_draws, config):
    logits, tokens = large_vocabulary_draws
    log_probs = truncated_scores(logits, *config).double().log_softmax(dim=-1)[0]
    drawn = log_probs[tokens[config]]
    outside = int(torch.isinf(drawn).sum())
    assert outside == 0, f"{outside} of {DRAWS} draws fell outside the top-k / top-p set"
    # Tokens holding 1e-4 / DRAWS of the probability together: a correct sampler draws one
    # of them in 1 run in 10,000. Noise that lets an arbitrary token win lands there.
    level = far_tail_level(log_probs, 1e-4 / DRAWS)
    rare = int((drawn < level).sum())
    assert rare == 0, f"{rare} of {DRAWS} draws from the tail below log-prob {level:.1f}"
    probabilities = log_probs.exp()
    inside = probabilities > 0
    expected = float((probabilities[inside] * log_probs[inside]).sum())
    spread = math.sqrt(float((probabilities[inside] * (log_probs[inside] - expected) ** 2).sum()))
    z = (float(drawn.mean()) - expected) / (spread / math.sqrt(DRAWS))
    assert abs(z) < Z_LIMIT, f"mean log-prob of draws {float(drawn.mean()):.4f} against exact {expected:.4f} (z {z:.2f})"


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (5, 1.0), (-1, 0.8)])
def test_token_frequencies_match_the_distribution_at_a_small_vocabulary(top_k, top_p):
    draws, vocab_size = 20_000, 16
    logits = logits_row(vocab_size, seed=2)
    probabilities = truncated_scores(logits, 0.6, top_k, top_p).double().softmax(dim=-1)[0]
    sampling = SamplingParams(temperature=0.6, top_k=top_k, top_p=top_p)
    tokens, _ = sample_next_tokens(logits.expand(draws, -1), sampling, torch.arange(draws), torch.full((draws,), 3))
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    inside = probabilities > 0
    assert counts[~inside].sum() == 0
    expected = draws * probabilities[inside]
    chi_square = float(((counts[inside] - expected) ** 2 / expected).sum())
    degrees = int(inside.sum()) - 1
    assert chi_square < degrees + Z_LIMIT * math.sqrt(2 * degrees)  # mean df, variance 2 df


def test_noise_tail_matches_the_gumbel_tail_over_all_hashes():
    # The transform is monotone in the hash, so its largest values come from one end of the
    # 2**32 hashes: counting over both ends gives the exact tail frequency of the noise.
    ends = torch.cat([torch.arange(2**20), torch.arange(2**32 - 2**20, 2**32)])
    noise = gumbel_from_hashes(ends)
    assert torch.isfinite(noise).all()
    for level in (10.0, 14.0, 18.0, 21.0):
        frequency = int((noise > level).sum()) / 2**32
        exact = -math.expm1(-math.exp(-level))  # P(Gumbel > level)
        assert abs(frequency - exact) <= 0.05 * exact + 1.5 / 2**32, (level, frequency, exact)
    assert float(noise.min()) < -2.5  # the low end is there too: P(Gumbel < -2.5) = 5e-6
