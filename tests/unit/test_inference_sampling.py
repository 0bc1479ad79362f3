"""Engine sampling: top-k / top-p truncation on hand-computed cases, greedy, hashed noise per sequence and position."""

import math

import torch

from ember.inference.hashing import gumbel_noise, row_keys
from ember.inference.sampling import sample_next_tokens, sequence_seed, truncated_scores
from ember.rollout.base import SamplingParams

# Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
LOGITS = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
ZERO = torch.zeros(1, dtype=torch.long)


def truncated_probabilities(logits, temperature, top_k, top_p):
    """The distribution a token is drawn from: softmax of the truncated, scaled scores."""
    return truncated_scores(logits, temperature, top_k, top_p).softmax(dim=-1)


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    probabilities = truncated_probabilities(LOGITS, temperature=1.0, top_k=2, top_p=1.0)
    torch.testing.assert_close(probabilities, torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 < 0.7 <= 0.5 + 0.25: the two most likely tokens form the nucleus.
    probabilities = truncated_probabilities(LOGITS, temperature=1.0, top_k=-1, top_p=0.7)
    torch.testing.assert_close(probabilities, torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]]))
    # top_p at or below the largest probability keeps only the argmax.
    only_best = truncated_probabilities(LOGITS, temperature=1.0, top_k=-1, top_p=0.5)
    torch.testing.assert_close(only_best, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_a_cut_keeps_every_token_tied_with_its_least_kept_one():
    # Probabilities 0.4, 0.2, 0.2, 0.2: top-p 0.5 reaches 0.5 inside the tie, and top-k 2 ends inside it; both keep
    # the whole tie, whatever the order of the tied logits.
    logits = torch.log(torch.tensor([[0.2, 0.4, 0.2, 0.2]]))
    for top_k, top_p in ((-1, 0.5), (2, 1.0), (2, 0.5), (3, 0.9)):
        kept = torch.isfinite(truncated_scores(logits, 1.0, top_k, top_p))
        assert kept.all(), (top_k, top_p, kept)
    assert torch.isfinite(truncated_scores(logits, 1.0, -1, 0.4)).tolist() == [[False, True, False, False]]


def test_the_cut_is_the_sorted_definition_and_ignores_the_order_of_equal_logits():
    """The top-k path finds its nucleus among the k largest without sorting the vocabulary: the kept set is
    the definition's (sort the row, keep the prefix whose mass before each token is below top_p, then every token
    tied with the prefix's last), and permuting the vocabulary permutes it."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        vocab = int(torch.randint(8, 700, (), generator=generator))
        logits = (torch.randn(6, vocab, generator=generator) * 3).bfloat16().float()  # bf16: many ties
        top_k = int(torch.randint(1, vocab + 3, (), generator=generator)) if trial % 3 else -1
        top_p = float(torch.rand((), generator=generator)) * 0.98 + 0.02 if trial % 4 else 1.0
        scaled = logits / 0.8
        expected = []
        for row in scaled:
            values = row.sort(descending=True).values
            if 0 < top_k < vocab:
                values = values[values >= values[top_k - 1]]
            probabilities = (values - values[0]).exp() / (values - values[0]).exp().sum()
            before = probabilities.cumsum(0) - probabilities
            kept = int((before < top_p).sum()) if top_p < 1 else len(values)
            expected.append(row >= values[max(kept, 1) - 1])
        kept = torch.isfinite(truncated_scores(logits, 0.8, top_k, top_p))
        assert torch.equal(kept, torch.stack(expected)), (trial, top_k, top_p)
        order = torch.randperm(vocab, generator=generator)
        assert torch.equal(torch.isfinite(truncated_scores(logits[:, order], 0.8, top_k, top_p)), kept[:, order])


def test_temperature_scales_logits_before_softmax():
    probabilities = truncated_probabilities(LOGITS, temperature=0.5, top_k=-1, top_p=1.0)
    squared = torch.tensor([[0.125, 0.5, 0.125, 0.25]]) ** 2
    torch.testing.assert_close(probabilities, squared / squared.sum())


def test_greedy_takes_the_argmax_and_returns_its_log_prob_at_temperature_one():
    tokens, log_probs = sample_next_tokens(LOGITS, SamplingParams(temperature=0.0), ZERO, ZERO)
    assert tokens.tolist() == [1]
    assert math.isclose(log_probs.item(), math.log(0.5), rel_tol=1e-6)


def test_log_prob_ignores_truncation():
    sampling = SamplingParams(temperature=1.0, top_k=1, seed=0)
    tokens, log_probs = sample_next_tokens(LOGITS, sampling, ZERO, ZERO)
    assert tokens.tolist() == [1]
    assert math.isclose(log_probs.item(), math.log(0.5), rel_tol=1e-6)  # not log(1) under the truncated distribution


def test_each_row_draws_from_its_own_seed_and_position_whatever_shares_the_batch():
    logits = torch.zeros(3, 1000)
    sampling = SamplingParams(temperature=1.0)
    seeds = torch.tensor([sequence_seed(5, sequence_id) for sequence_id in range(3)])
    positions = torch.tensor([10, 10, 11])
    first, _ = sample_next_tokens(logits, sampling, seeds, positions)
    second, _ = sample_next_tokens(logits, sampling, seeds, positions)
    alone, _ = sample_next_tokens(logits[2:], sampling, seeds[2:], positions[2:])
    moved, _ = sample_next_tokens(logits[:1], sampling, seeds[:1], positions[:1] + 1)
    assert first.tolist() == second.tolist()
    assert alone.tolist() == first[2:].tolist()
    assert len(set(first.tolist())) > 1
    assert moved.tolist() != first[:1].tolist()  # the next position draws afresh (1 in 1000 to collide)
    assert sequence_seed(5, 0) == sequence_seed(5, 0) != sequence_seed(6, 0)


def test_hashed_noise_is_uniform_and_independent_across_vocabulary_and_rows():
    noise = gumbel_noise(row_keys(torch.arange(64), torch.zeros(64, dtype=torch.long)), 4096)
    uniform = torch.exp(-torch.exp(-noise))  # the Gumbel CDF maps the noise back to U(0, 1)
    counts = torch.histc(uniform, bins=16, min=0, max=1)
    expected = uniform.numel() / 16
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 15 + 5 * math.sqrt(30)
    neighbours = torch.corrcoef(torch.stack([uniform[:, :-1].flatten(), uniform[:, 1:].flatten()]))[0, 1]
    rows = torch.corrcoef(torch.stack([uniform[:-1].flatten(), uniform[1:].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.01 and abs(float(rows)) < 0.01


def test_the_host_hash_of_one_value_is_the_tensor_hash():
    """Per-sequence seeds are hashed on the host in Python ints; they must be the tensor hash's bits
    (so seeded runs draw what they drew before and what the Triton kernel's arithmetic expects)."""
    from ember.inference.hashing import MASK32, mix32, mix32_int

    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, MASK32] + [
        int(v) for v in torch.randint(0, 1 << 32, (2000,), generator=torch.Generator().manual_seed(3))]
    assert [mix32_int(value) for value in values] == mix32(torch.tensor(values)).tolist()
