"""The engine's stop-token scan of a window's tokens: the first stop token among the tokens a sequence may keep."""

from ember.inference.engine import first_stop


def test_first_stop_is_the_first_stop_token_among_the_kept_tokens():
    assert first_stop([4, 7, 9, 7], 4, {7, 9}) == 1
    assert first_stop([4, 5, 9, 9], 2, {9}) is None  # past the sequence's token budget: not its stop
    assert first_stop([4, 5, 9], 3, {8}) is None
    assert first_stop([4, 5, 9], 3, set()) is None  # ignore_eos
