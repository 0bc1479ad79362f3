"""Packing a padded Batch into one row of real tokens, and unpacking per-token outputs back
to the response layout (ember/data/packing.py)."""

import torch

from ember.data.batch import Batch
from ember.data.packing import pack_batch

EOS = 1
PROMPTS = [[11, 12, 13], [21], [31, 32, 33, 34, 35], [41, 42]]
RESPONSES = [[14, 15, EOS, 99, 99], [22, 23, 24, 25, 26], [36], [43, 44, 45]]  # sample 0 stops at EOS
COUNTED = [[14, 15, EOS], [22, 23, 24, 25, 26], [36], [43, 44, 45]]


def mixed_batch() -> Batch:
    """Left-padded prompts and right-padded responses of mixed lengths, one with tokens after its EOS."""
    return Batch.from_rollout(PROMPTS, RESPONSES, pad_token_id=0, eos_token_ids=[EOS])


def test_packed_row_holds_every_real_token_with_positions_restarting_per_sample():
    packing = pack_batch(mixed_batch())
    sequences = [prompt + response for prompt, response in zip(PROMPTS, COUNTED)]
    assert packing.input_ids.tolist() == [[token for sequence in sequences for token in sequence]]
    assert packing.position_ids.tolist() == [[p for sequence in sequences for p in range(len(sequence))]]
    lengths = [len(sequence) for sequence in sequences]
    assert packing.cu_seqlens.dtype == torch.int32
    assert packing.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()


def test_each_prediction_position_is_followed_by_its_target_in_the_same_sample():
    packing = pack_batch(mixed_batch())
    assert packing.targets.tolist() == [token for response in COUNTED for token in response]
    row = packing.input_ids[0]
    assert torch.equal(row[packing.prediction_index + 1], packing.targets)
    starts = packing.cu_seqlens[:-1].long()
    sample_of = torch.searchsorted(starts, packing.prediction_index, right=True) - 1
    sample_of_target = torch.searchsorted(starts, packing.prediction_index + 1, right=True) - 1
    assert torch.equal(sample_of, sample_of_target)  # a prediction never reaches into the next sample


def test_unpack_puts_each_value_at_its_response_position_and_zero_elsewhere():
    batch = mixed_batch()
    packing = pack_batch(batch)
    values = torch.arange(1, len(packing.targets) + 1, dtype=torch.float32)
    unpacked = packing.unpack(values)
    assert unpacked.shape == (len(batch), batch.response_length)
    expected = torch.zeros(len(batch), batch.response_length)
    counter = 1
    for row, response in enumerate(COUNTED):
        for column in range(len(response)):
            expected[row, column] = counter
            counter += 1
    assert torch.equal(unpacked, expected)
    # A round trip: the packed values, read back at the response slots, are unchanged.
    assert torch.equal(unpacked[packing.response_slots], values)
    assert torch.equal(unpacked[batch.response_mask.bool()], values)


def test_unpack_passes_gradients_to_the_packed_values():
    packing = pack_batch(mixed_batch())
    values = torch.randn(len(packing.targets), requires_grad=True)
    weights = torch.randn(packing.response_slots.shape)
    (packing.unpack(values) * weights).sum().backward()
    assert torch.equal(values.grad, weights[packing.response_slots])


def test_sft_layout_with_a_one_token_prompt_and_right_padding():
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    batch = Batch(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0), response_mask=attention_mask[:, 1:])
    packing = pack_batch(batch)
    assert packing.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packing.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert packing.prediction_index.tolist() == [0, 1, 2, 4]
    assert packing.targets.tolist() == [6, 7, 8, 10]
    assert packing.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 2, 3], [4, 0, 0]]


def test_extra_padding_columns_change_nothing_in_the_packed_row():
    """Extra all-padding columns (as `Batch.concat` adds) change nothing in the packed row."""
    batch = mixed_batch()
    wider = Batch.concat([batch, Batch.from_rollout([[7] * 8], [[8] * 7], pad_token_id=0)]).select(range(len(batch)))
    narrow, wide = pack_batch(batch), pack_batch(wider)
    assert torch.equal(narrow.input_ids, wide.input_ids)
    assert torch.equal(narrow.position_ids, wide.position_ids)
    assert torch.equal(narrow.prediction_index, wide.prediction_index)
    values = torch.randn(len(narrow.targets))
    assert torch.equal(wide.unpack(values)[:, :batch.response_length], narrow.unpack(values))
