"""BlockManager: block tables, sharing of a prompt's full blocks between its samples, release by reference count."""

import pytest

from ember.inference.block_manager import BlockManager
from ember.inference.sequence import Sequence


def sequences(num_tokens: int, n: int) -> list[Sequence]:
    return [Sequence(i, num_tokens, list(range(num_tokens)), None, max_new_tokens=8) for i in range(n)]


def test_samples_share_full_blocks_and_get_own_copy_of_the_partial_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    group = sequences(10, n=3)  # 2 full blocks + 2 tokens
    assert manager.blocks_for_group(10, 3) == 2 + 3

    copies = manager.allocate_group(group)

    leader, *followers = group
    assert leader.block_table == [0, 1, 2]
    assert [follower.block_table for follower in followers] == [[0, 1, 3], [0, 1, 4]]
    assert copies == [(2, 3), (2, 4)]
    assert manager.num_free_blocks == 3


def test_prompt_filling_whole_blocks_is_shared_entirely_and_each_sample_appends_its_own_block():
    manager = BlockManager(num_blocks=6, block_size=4)
    group = sequences(8, n=2)
    assert manager.allocate_group(group) == []
    assert group[0].block_table == group[1].block_table == [0, 1]
    for sequence in group:
        sequence.append(1, 0.0)  # token 8 needs a third block
        manager.append_slot(sequence)
    assert group[0].block_table == [0, 1, 2] and group[1].block_table == [0, 1, 3]
    assert manager.num_free_blocks == 2


def test_append_slot_takes_a_block_only_when_the_last_one_is_full():
    manager = BlockManager(num_blocks=4, block_size=4)
    [sequence] = sequences(3, n=1)
    manager.allocate_group([sequence])
    sequence.append(7, 0.0)  # 4 tokens: still one block
    manager.append_slot(sequence)
    assert sequence.block_table == [0]
    sequence.append(7, 0.0)  # 5 tokens
    assert manager.blocks_missing(sequence) == 1
    manager.append_slot(sequence)
    assert sequence.block_table == [0, 1]
    assert manager.slot(sequence, 4) == 1 * 4 + 0
    assert manager.slot(sequence, 2) == 0 * 4 + 2


def test_try_append_takes_every_missing_block_or_none():
    manager = BlockManager(num_blocks=4, block_size=4)
    [sequence] = sequences(3, n=1)
    manager.allocate_group([sequence])
    assert not manager.try_append(sequence, 17)  # 5 blocks: 4 missing, 3 free
    assert sequence.block_table == [0] and manager.num_free_blocks == 3
    assert manager.try_append(sequence, 12)  # a window's tokens up to 12: 2 more blocks
    assert sequence.block_table == [0, 1, 2] and manager.num_free_blocks == 1
    assert manager.try_append(sequence, 12) and sequence.block_table == [0, 1, 2]  # nothing missing


def test_shared_blocks_return_to_the_pool_only_when_every_sample_released_them():
    manager = BlockManager(num_blocks=8, block_size=4)
    group = sequences(10, n=3)
    manager.allocate_group(group)
    manager.free(group[0])
    assert manager.num_free_blocks == 3 + 1  # only the leader's own partial block
    manager.free(group[1])
    assert manager.num_free_blocks == 3 + 2
    manager.free(group[2])
    assert manager.num_free_blocks == 8
    assert all(sequence.block_table == [] for sequence in group)


def test_can_allocate_counts_the_samples_partial_blocks():
    manager = BlockManager(num_blocks=4, block_size=4)
    assert manager.can_allocate_group(sequences(5, n=3))  # 1 shared + 3 partial
    assert not manager.can_allocate_group(sequences(5, n=4))  # 1 + 4 > 4
    with pytest.raises(RuntimeError, match="can_allocate_group"):
        manager.allocate_group(sequences(5, n=4))
