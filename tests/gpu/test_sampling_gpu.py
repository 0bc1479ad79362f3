"""The Triton sampling kernel draws from the distribution it claims: against exact expectations
at a real vocabulary size (temperatures below and at 1, with and without top-k / top-p), the
frequency of a token that only the noise's far tail can pick, and the PyTorch path on CPU.

Seeds are fixed, so every check is deterministic; the limits sit where a correct sampler
passes by a wide margin (|z| < 4).
"""

from __future__ import annotations

import math

import pytest
import torch

from ember.inference.sampling import kept_threshold, sample_next_tokens, truncated_scores
from ember.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

Z_LIMIT = 4.0
CONFIGS = [(temperature, top_k, top_p) for temperature in (0.3, 0.6, 1.0) for top_k, top_p in ((-1, 1.0), (50, 1.0), (-1, 0.9))]


def draws(logits_row: torch.Tensor, sampling: SamplingParams, batches: int, rows: int) -> torch.Tensor:
    """Tokens of batches × rows draws from one logits row: each batch at its own position, each row its own seed."""
    seeds = torch.arange(rows, device="cuda") * 7919 + 13
    tokens = [sample_next_tokens(logits_row.expand(rows, -1), sampling, seeds, torch.full_like(seeds, batch))[0]
              for batch in range(batches)]
    return torch.cat(tokens)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"T{t}-k{k}-p{p}" for t, k, p in CONFIGS])
def test_kernel_draws_at_a_real_vocabulary_follow_the_exact_distribution(config):
    temperature, top_k, top_p = config
    # logits ~ N(0, 3²) whose top tokens are close (seed 1): even at T = 0.3 the draws spread over several
    logits = torch.randn(1, 49_152, generator=torch.Generator().manual_seed(1)).cuda() * 3
    tokens = draws(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), batches=8, rows=8192)
    log_probs = truncated_scores(logits, *config).double().log_softmax(dim=-1)[0]
    drawn = log_probs[tokens]
    assert not torch.isinf(drawn).any(), "a draw fell outside the top-k / top-p set"
    probabilities = log_probs.exp()
    inside = probabilities > 0
    expected = float((probabilities[inside] * log_probs[inside]).sum())
    spread = math.sqrt(float((probabilities[inside] * (log_probs[inside] - expected) ** 2).sum()))
    z = (float(drawn.mean()) - expected) / (spread / math.sqrt(len(tokens)))
    assert abs(z) < Z_LIMIT, f"mean log-prob of draws {float(drawn.mean()):.4f} against exact {expected:.4f} (z {z:.2f})"


def test_a_token_only_the_noise_tail_can_pick_is_drawn_as_often_as_its_probability():
    # Token 0 at logit 0, the other 151,935 at -17: one of those wins a draw when its noise
    # beats token 0's by 17 or more, so the count tests the noise's tail where it matters.
    vocab_size, gap = 151_936, 17.0
    logits = torch.full((1, vocab_size), -gap, device="cuda", dtype=torch.bfloat16)
    logits[0, 0] = 0
    tokens = draws(logits, SamplingParams(temperature=1.0), batches=8, rows=8192)
    rare_probability = (vocab_size - 1) * math.exp(-gap) / (1 + (vocab_size - 1) * math.exp(-gap))
    expected = len(tokens) * rare_probability
    count = int((tokens != 0).sum())
    z = (count - expected) / math.sqrt(expected * (1 - rare_probability))
    assert abs(z) < Z_LIMIT, f"{count} draws of the unlikely tokens against {expected:.0f} expected (z {z:.2f})"


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_kernel_draws_the_tokens_of_the_pytorch_path_on_cpu(top_p):
    logits = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(1)) * 4
    seeds, positions = torch.randint(0, 2**31, (64,), generator=torch.Generator().manual_seed(2)), torch.arange(64) * 5
    sampling = SamplingParams(temperature=0.7, top_p=top_p)
    cpu_tokens, cpu_log_probs = sample_next_tokens(logits, sampling, seeds, positions)
    cuda_tokens, cuda_log_probs = sample_next_tokens(logits.cuda(), sampling, seeds.cuda(), positions.cuda())
    same = cuda_tokens.cpu() == cpu_tokens
    assert same.float().mean() >= 62 / 64  # float rounding of the logits / log1p may flip a near-tie
    torch.testing.assert_close(cuda_log_probs.cpu()[same], cpu_log_probs[same], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_nucleus_search_cuts_where_the_sorted_row_does(scale):
    """Top-p without top-k on CUDA searches for the cut (`kernels/nucleus.py`); in float64 the sorted row says where
    it lies. Every row whose cut is clear of top_p by more than float32 sums can blur keeps exactly that set."""
    logits = torch.randn(256, 151_936, generator=torch.Generator().manual_seed(3)) * scale
    logits[:64] = logits[:64].round()  # wide ties: the cut keeps the whole group of its least kept value
    logits[64:72, :1000] = float("-inf")
    for top_p in (0.5, 0.9, 0.95):
        kept = logits >= kept_threshold(logits.cuda(), -1, top_p).cpu()
        exact = logits.double()
        exactly_kept = exact >= kept_threshold(exact, -1, top_p)
        ordered = exact.sort(dim=-1, descending=True).values
        probabilities = (ordered - ordered[:, :1]).exp()
        probabilities /= probabilities.sum(-1, keepdim=True)
        first_of_value = torch.ones_like(ordered, dtype=torch.bool)
        first_of_value[:, 1:] = ordered[:, 1:] != ordered[:, :-1]  # where the mass before a value can cross top_p
        mass_before = probabilities.cumsum(-1) - probabilities
        margin = torch.where(first_of_value, (mass_before - top_p).abs(), torch.inf).min(-1).values
        clear = margin > 1e-6  # float32's sorted path too parts from float64 at margins near 1e-7
        assert clear.sum() >= 64, "too few rows away from the rounding of the sums to test anything"
        assert torch.equal(kept[clear], exactly_kept[clear]), f"top_p {top_p}: rows cut elsewhere"
