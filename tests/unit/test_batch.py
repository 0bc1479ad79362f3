"""Batch: padding, masks and positions from rollout token lists; select / split / concat."""

import pytest
import torch

from ember.data.batch import Batch

PAD, EOS = 0, 9


def _rollout_batch() -> Batch:
    return Batch.from_rollout(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[1, 2, EOS], [3, EOS, 4, 4]],
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        rollout_log_probs=[[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6, -0.7]],
        uids=["a", "b"],
        data_sources=["gsm8k", "math"],
        ground_truths=["1", "2"],
        extra_infos=[{"i": 0}, {"i": 1}],
    )


def test_from_rollout_pads_prompts_left_and_responses_right():
    batch = _rollout_batch()
    assert (batch.prompt_length, batch.response_length, len(batch)) == (3, 4, 2)
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2, EOS, PAD], [PAD, PAD, 8, 3, EOS, 4, 4]]
    assert batch.responses.tolist() == [[1, 2, EOS, PAD], [3, EOS, 4, 4]]


def test_from_rollout_masks_stop_at_first_eos_inclusive():
    batch = _rollout_batch()
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0]]


def test_from_rollout_positions_count_real_tokens_only():
    batch = _rollout_batch()
    assert batch.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.position_ids[1, 2:5].tolist() == [0, 1, 2]


def test_from_rollout_log_probs_and_metadata():
    batch = _rollout_batch()
    assert torch.allclose(batch.rollout_log_probs, torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-0.4, -0.5, -0.6, -0.7]]))
    assert batch.uids == ["a", "b"] and batch.extra_infos[1] == {"i": 1}


def test_from_rollout_response_without_eos_counts_every_token():
    batch = Batch.from_rollout([[1]], [[2, 3]], pad_token_id=PAD, eos_token_ids=EOS, response_length=4)
    assert batch.response_mask.tolist() == [[1, 1, 0, 0]]


def test_from_rollout_rejects_too_short_fixed_length_and_empty_prompt():
    with pytest.raises(ValueError, match="prompt_length=1"):
        Batch.from_rollout([[1, 2]], [[3]], pad_token_id=PAD, prompt_length=1)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        Batch.from_rollout([[]], [[3]], pad_token_id=PAD)


def test_from_rollout_of_many_ragged_rows_equals_row_by_row_padding():
    """The whole batch is padded at once (one fill per kind of row); each row must come out as padding it
    alone would: prompts right-aligned, responses left-aligned, attended up to the first of several stop ids,
    a masked (multi-turn) row attended whole, log-probs where given."""
    import random

    rng = random.Random(0)
    stops, pad = {1, 2}, 0
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(1, 9))] for _ in range(40)]
    responses = [[rng.choice([1, 2] + list(range(3, 50)) * 4) for _ in range(rng.randint(0, 12))] for _ in range(40)]
    masks = [None if i % 5 else [i % 2] * len(response) for i, response in enumerate(responses)]
    log_probs = [[-rng.random() for _ in response] for response in responses]
    batch = Batch.from_rollout(prompts, responses, pad_token_id=pad, eos_token_ids=stops, rollout_log_probs=log_probs,
                               response_masks=masks, prompt_length=10, response_length=14)
    for i, (prompt, response, mask) in enumerate(zip(prompts, responses, masks)):
        counted = len(response) if mask is not None else next(
            (position + 1 for position, token in enumerate(response) if token in stops), len(response))
        row = [pad] * (10 - len(prompt)) + prompt + response + [pad] * (14 - len(response))
        attended = [0] * (10 - len(prompt)) + [1] * len(prompt) + [1] * counted + [0] * (24 - 10 - counted)
        assert batch.input_ids[i].tolist() == row
        assert batch.attention_mask[i].tolist() == attended
        expected_mask = (mask + [0] * (14 - len(mask))) if mask is not None else attended[10:]
        assert batch.response_mask[i].tolist() == expected_mask
        assert batch.rollout_log_probs[i, :len(response)].tolist() == pytest.approx(log_probs[i])
        assert not batch.rollout_log_probs[i, len(response):].any()


def test_select_reorders_every_field():
    batch = _rollout_batch().with_fields(advantages=torch.tensor([[1.0] * 4, [2.0] * 4]))
    picked = batch.select([1, 0, 1])
    assert picked.uids == ["b", "a", "b"]
    assert picked.input_ids[0].tolist() == batch.input_ids[1].tolist()
    assert picked.advantages[:, 0].tolist() == [2.0, 1.0, 2.0]
    assert picked.ref_log_probs is None


def test_split_concat_round_trip():
    batch = Batch.concat([_rollout_batch()] * 3).with_fields(values=torch.arange(24.0).reshape(6, 4))
    parts = batch.split(4)
    assert [len(part) for part in parts] == [4, 2]
    joined = Batch.concat(parts)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs", "values"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
    assert joined.uids == batch.uids and joined.ground_truths == batch.ground_truths
    assert joined.old_log_probs is None


def test_concat_repads_batches_of_different_lengths():
    short = Batch.from_rollout([[5]], [[1]], pad_token_id=PAD)
    long = Batch.from_rollout([[5, 6, 7]], [[1, 2, 3]], pad_token_id=PAD)
    joined = Batch.concat([short, long])
    assert (joined.prompt_length, joined.response_length) == (3, 3)
    assert joined.input_ids[0].tolist() == [0, 0, 5, 1, 0, 0]
    assert joined.attention_mask[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert joined.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]


def test_concat_refuses_a_field_set_in_only_some_batches():
    with_log_probs = Batch.from_rollout([[5]], [[1]], pad_token_id=PAD, rollout_log_probs=[[-1.0]])
    without = Batch.from_rollout([[5]], [[1]], pad_token_id=PAD)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        Batch.concat([with_log_probs, without])


def test_shapes_are_validated():
    batch = _rollout_batch()
    with pytest.raises(ValueError, match="advantages"):
        batch.with_fields(advantages=torch.zeros(2, 7))
    with pytest.raises(ValueError, match="uids"):
        batch.with_fields(uids=["only-one"])
