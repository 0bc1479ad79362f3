"""PromptLoader: epochs, seeded shuffling, and resuming from a state dict with the same next batches."""

from __future__ import annotations

import pytest

from ember.data.prompt_loader import PromptLoader


def take(loader, count):
    """The next `count` batches, walking into later epochs as the trainer's loop does."""
    taken = []
    while True:
        for batch in loader:
            taken.append(batch)
            if len(taken) == count:
                return taken


def test_length_is_steps_per_epoch():
    assert len(PromptLoader(list(range(10)), batch_size=3)) == 3
    assert len(PromptLoader(list(range(10)), batch_size=3, drop_last=False)) == 4
    assert len(PromptLoader(list(range(9)), batch_size=3, drop_last=False)) == 3


def test_an_epoch_visits_every_sample_once():
    loader = PromptLoader(list(range(10)), batch_size=3, drop_last=False, seed=5)
    epoch = list(loader)
    assert [len(batch) for batch in epoch] == [3, 3, 3, 1]
    assert sorted(sample for batch in epoch for sample in batch) == list(range(10))
    assert loader.state_dict() == {"seed": 5, "epoch": 1, "position": 0, "samples": 10, "batch_size": 3, "shuffle": 1}


def test_without_shuffle_the_order_is_the_dataset_order():
    loader = PromptLoader(list("abcdefg"), batch_size=2, shuffle=False)
    assert list(loader) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert list(loader) == [["a", "b"], ["c", "d"], ["e", "f"]]


def test_order_depends_on_seed_and_epoch_only():
    data = list(range(40))
    first = take(PromptLoader(data, batch_size=4, seed=1), 20)
    assert first == take(PromptLoader(data, batch_size=4, seed=1), 20)
    assert first != take(PromptLoader(data, batch_size=4, seed=2), 20)
    assert first[:10] != first[10:]  # epoch 1 is shuffled differently from epoch 0
    assert sorted(sum(first[10:], [])) == data


@pytest.mark.parametrize("steps_before_resume", [3, 5, 10, 13])
def test_resume_from_state_dict_gives_the_same_next_batches(steps_before_resume):
    data = list(range(23))
    running = PromptLoader(data, batch_size=4, seed=7)  # 5 steps per epoch, 3 samples dropped
    take(running, steps_before_resume)
    state = running.state_dict()
    resumed = PromptLoader(data, batch_size=4, seed=123)
    resumed.load_state_dict(state)
    assert take(resumed, 8) == take(running, 8)
    assert resumed.state_dict() == running.state_dict()


def test_state_after_the_last_batch_points_to_the_next_epoch():
    loader = PromptLoader(list(range(8)), batch_size=4)
    batches = iter(loader)
    next(batches)
    assert loader.state_dict()["position"] == 1
    next(batches)
    assert (loader.epoch, loader.position) == (1, 0)


def test_dataset_smaller_than_a_batch_is_an_error_naming_the_keys():
    with pytest.raises(ValueError, match=r"3 prompts, fewer than one batch of 8.*data.train_batch_size"):
        PromptLoader([1, 2, 3], batch_size=8)
    assert list(PromptLoader([1, 2, 3], batch_size=8, shuffle=False, drop_last=False)) == [[1, 2, 3]]


def test_state_from_a_different_dataset_is_rejected():
    loader = PromptLoader(list(range(8)), batch_size=4)
    with pytest.raises(ValueError, match="same data files and data.train_batch_size"):
        loader.load_state_dict({"seed": 1, "epoch": 0, "position": 5})


@pytest.mark.parametrize("dataset, batch_size, shuffle, named", [
    (list(range(12)), 4, True, "samples 16 then, 12 now"),  # rows added or filtered away: another permutation
    (list(range(16)), 2, True, "batch_size 4 then, 2 now"),  # position 1 of another batch size
    (list(range(16)), 4, False, "shuffle 1 then, 0 now"),
])
def test_a_state_of_a_loader_over_other_data_is_refused_even_where_its_position_fits(dataset, batch_size, shuffle,
                                                                                   named):
    running = PromptLoader(list(range(16)), batch_size=4, seed=3)
    take(running, 1)
    state = running.state_dict()
    with pytest.raises(ValueError, match=named):
        PromptLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=3).load_state_dict(state)
    legacy = {key: state[key] for key in ("seed", "epoch", "position")}  # saved before these were: position only
    PromptLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=3).load_state_dict(legacy)
