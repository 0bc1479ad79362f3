"""Scheduler: prefill batches under the slot and token limits, slot refill, preemption when blocks run out."""

import pytest

from ember.inference.block_manager import BlockManager
from ember.inference.config import EngineConfig
from ember.inference.scheduler import Scheduler
from ember.inference.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int = 64, **overrides) -> Scheduler:
    config = EngineConfig(**dict(dict(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32, block_size=4), **overrides))
    return Scheduler(config, BlockManager(num_blocks, config.block_size))


def group(first_id: int, num_tokens: int, n: int = 1) -> list[Sequence]:
    return [Sequence(first_id + i, num_tokens, [1] * num_tokens, None, max_new_tokens=8) for i in range(n)]


def sample_one_token(sequences: list[Sequence]) -> None:
    for sequence in sequences:
        sequence.append(2, -1.0)


def test_finished_sequence_frees_its_slot_for_the_next_prompt():
    scheduler = make_scheduler(max_num_seqs=2)
    groups = [group(i, 3) for i in range(3)]
    for waiting in groups:
        scheduler.add_group(waiting)

    step = scheduler.schedule()
    assert step.is_prefill and step.groups == groups[:2]
    sample_one_token(step.sequences)
    step = scheduler.schedule()
    assert not step.is_prefill and step.decode_sequences == groups[0] + groups[1]
    sample_one_token(step.sequences)

    free_before = scheduler.block_manager.num_free_blocks
    scheduler.finish(groups[0][0], "stop")
    assert groups[0][0].status is SequenceStatus.FINISHED
    assert scheduler.block_manager.num_free_blocks == free_before + 1  # its 4 cached tokens held 1 block
    step = scheduler.schedule()
    assert step.is_prefill and step.groups == [groups[2]]


def test_prefill_batch_stays_under_max_num_batched_tokens():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    for index, length in enumerate([20, 10, 5]):
        scheduler.add_group(group(index, length))
    step = scheduler.schedule()
    assert [len(g[0]) for g in step.groups] == [20, 10]  # 20 + 10 + 5 > 32
    sample_one_token(step.sequences)
    assert [len(g[0]) for g in scheduler.schedule().groups] == [5]


def test_samples_of_one_prompt_are_one_group_split_at_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=4)
    scheduler.add_group(group(0, 3, n=6))
    step = scheduler.schedule()
    assert [len(g) for g in step.groups] == [4]
    assert [s.sequence_id for s in step.sequences] == [0, 1, 2, 3]


def test_decode_without_free_blocks_preempts_the_newest_sequence_which_resumes_with_its_tokens():
    # 2 sequences of 4 tokens fill 2 of 3 blocks; the 5th token of each needs one more block.
    scheduler = make_scheduler(num_blocks=3, max_model_len=12, max_num_batched_tokens=12)
    first, second = group(0, 3), group(1, 3)
    scheduler.add_group(first)
    scheduler.add_group(second)
    sample_one_token(scheduler.schedule().sequences)  # prefill both: 4 tokens each
    sample_one_token(scheduler.schedule().sequences)  # decode: 4 tokens each written... now 5 tokens
    step = scheduler.schedule()

    assert step.decode_sequences == first
    assert second[0].status is SequenceStatus.WAITING and second[0].block_table == []
    assert list(scheduler.waiting) == [second]
    assert len(second[0]) == 5 and second[0].log_probs == [-1.0, -1.0]

    scheduler.finish(first[0], "length")
    step = scheduler.schedule()
    assert step.is_prefill and step.groups == [second]
    assert len(second[0].block_table) == 2  # all 5 tokens prefilled again


def test_a_group_the_whole_cache_cannot_hold_fails_naming_the_setting():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=16)
    scheduler.add_group(group(0, 5, n=9))  # 1 shared + 9 partial blocks > 8
    with pytest.raises(RuntimeError, match="num_kv_blocks"):
        scheduler.schedule()


def test_config_refuses_a_cache_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="raise num_kv_blocks"):
        EngineConfig(max_model_len=32, max_num_batched_tokens=32, block_size=4, num_kv_blocks=7)


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks_and_runs_once_complete():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    long_group, short_group = group(0, 9, n=2), group(2, 3)
    scheduler.add_group(long_group)
    scheduler.add_group(short_group)
    steps = [scheduler.schedule() for _ in range(3)]
    assert [[(c.start, c.length) for c in step.chunks] for step in steps] == [[(0, 4)], [(4, 4)], [(8, 1), (0, 3)]]
    assert [step.sequences for step in steps[:2]] == [[], []]  # nothing samples until a prompt is complete
    assert steps[2].sequences == long_group + short_group
    assert steps[2].block_copies and not steps[0].block_copies  # the second sample's own last block, at the end
    assert scheduler.running == long_group + short_group and scheduler.partial is None


def test_without_chunked_prefill_the_budget_must_hold_a_whole_sequence():
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(max_model_len=32, max_num_batched_tokens=16, enable_chunked_prefill=False)
