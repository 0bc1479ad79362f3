"""Loss aggregation modes, the micro-batch share identity, and the clipped value loss."""

import pytest
import torch

from ember.algorithms import LOSS_AGG_MODES, aggregate_loss, compute_value_loss, count_tokens_and_sequences

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])  # 100 sits under the mask
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize("mode, norm_length, expected", [
    ("token-mean", None, 15 / 5),
    ("token-sum", None, 15),
    ("seq-mean-token-sum", None, (6 + 9) / 2),
    ("seq-mean-token-mean", None, (6 / 3 + 9 / 2) / 2),
    ("seq-mean-token-sum-norm", None, (6 / 3 + 9 / 3) / 2),  # default norm_length: padded width 3
    ("seq-mean-token-sum-norm", 10, (6 / 10 + 9 / 10) / 2),
])
def test_modes_hand_computed(mode, norm_length, expected):
    assert aggregate_loss(LOSS, mask=MASK, mode=mode, norm_length=norm_length).item() == pytest.approx(expected)


def test_seq_mean_token_mean_divides_a_one_token_sequence_by_one():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(LOSS, mask=mask, mode="seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean"):
        aggregate_loss(LOSS, mask=MASK, mode="sum")


def test_counts_skip_padding_and_empty_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    tokens, sequences = count_tokens_and_sequences(mask)
    assert (tokens.item(), sequences.item()) == (4, 2)
    assert aggregate_loss(torch.ones(1, 3), mask=torch.zeros(1, 3), mode="token-mean").item() == 0  # not nan


def random_mini_batch(seed, batch_size=7, width=6):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch_size,), generator=generator)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    return torch.randn(batch_size, width, generator=generator), mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_shares_add_up_to_the_mini_batch_loss(mode):
    loss_matrix, mask = random_mini_batch(seed=3)
    width = mask.shape[1]
    whole = aggregate_loss(loss_matrix, mask=mask, mode=mode, norm_length=width)
    num_tokens, num_sequences = count_tokens_and_sequences(mask)
    shares = []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 7)):  # uneven micro-batches
        micro_loss, micro_mask = loss_matrix[rows], mask[rows]
        trimmed = int(micro_mask.sum(dim=-1).max())  # each micro-batch padded to its own length
        shares.append(aggregate_loss(micro_loss[:, :trimmed], mask=micro_mask[:, :trimmed], mode=mode,
                                     num_tokens=num_tokens, num_sequences=num_sequences, norm_length=width))
    assert torch.allclose(sum(shares), whole, atol=1e-6)


def test_token_sum_share_is_the_micro_batch_sum_whatever_the_global_counts():
    """verl's token-sum: Σ over the mini-batch's valid tokens; each micro-batch adds its own sum
    and the engine's × dp_size undoes the ranks' gradient averaging, so nothing is divided."""
    for counts in ({}, {"num_tokens": 1000, "num_sequences": 7}):
        assert aggregate_loss(LOSS, mask=MASK, mode="token-sum", **counts).item() == 15
    loss_matrix = LOSS.clone().requires_grad_()
    aggregate_loss(loss_matrix, mask=MASK, mode="token-sum").backward()
    assert torch.equal(loss_matrix.grad, MASK)  # every valid token weighs 1, padding 0


def test_local_normalisation_of_uneven_micro_batches_differs_from_the_whole():
    loss_matrix, mask = random_mini_batch(seed=3)
    whole = aggregate_loss(loss_matrix, mask=mask, mode="token-mean")
    halves = [aggregate_loss(loss_matrix[rows], mask=mask[rows], mode="token-mean") for rows in (slice(0, 1), slice(1,
                                                                                                                    7))]
    assert not torch.allclose(sum(halves) / 2, whole)  # why the global counts are needed


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 2.0, 3.1, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    result = compute_value_loss(predicted_values=values, old_values=old_values, returns=returns,
                                response_mask=mask, cliprange_value=0.2)
    # token 0: clipped value 0.7 → max((1-2)², (0.7-2)²) = 1.69 (clipped branch)
    # token 1: no move → 1.0;  token 2: inside the range, the clipped value is the prediction → 0.0
    assert result.loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.0) / 3)
    assert result.clipfrac.item() == pytest.approx(1 / 3)
    result.loss.backward()
    # the clipped branch is constant in the prediction; elsewhere d/dV 0.5·(V-R)²/3 = (V-R)/3
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1.0 / 3, 0.0, 0.0]]))


def test_value_clipfrac_counts_no_token_inside_the_range():
    """old + clamp(new - old) is not exactly `new` in float32 (-0.4 comes back as -0.40000004),
    which made this unclipped token count as clipped; verl reports 0."""
    result = compute_value_loss(predicted_values=torch.tensor([[-0.4]]), old_values=torch.tensor([[0.08]]),
                                returns=torch.tensor([[1.0]]), response_mask=torch.ones(1, 1), cliprange_value=0.5)
    assert result.clipfrac.item() == 0.0
    assert result.loss.item() == pytest.approx(0.5 * 1.4 ** 2)


def test_value_loss_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        compute_value_loss(torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.5)


def test_value_loss_forwards_aggregation_arguments():
    values, old_values, returns = torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3)
    result = compute_value_loss(predicted_values=values, old_values=old_values, returns=returns, response_mask=MASK,
                                cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum", num_sequences=4)
    assert result.loss.item() == pytest.approx(0.5 * (3 + 2) / 4)
