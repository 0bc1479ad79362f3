"""The marker: the fork's first rare character the tokenizer keeps as one token, recorded with the data and checked."""

import pytest
from fixtures import NLA_MARKER, make_nla_tokenizer, make_tokenizer

from ember.config import ConfigError
from ember.data.parquet import DatasetError, write_parquet
from ember.models.tiny import train_tiny_tokenizer
from ember.nla.marker import (
    MARKER_CANDIDATES,
    Marker,
    check_recorded_marker,
    choose_marker,
    marker_metadata,
    marker_problem,
    recorded_marker,
)


def test_the_forks_list_in_its_order():
    assert len(MARKER_CANDIDATES) == 40 and len(set(MARKER_CANDIDATES)) == 40
    assert MARKER_CANDIDATES[:2] == ("㊗", "㊙") and MARKER_CANDIDATES.index(NLA_MARKER) == 25


def test_first_candidate_kept_as_one_token_is_chosen():
    tokenizer = make_nla_tokenizer()
    assert all(marker_problem(tokenizer, character) is not None for character in MARKER_CANDIDATES[:25])
    marker = choose_marker(tokenizer)
    assert marker.character == NLA_MARKER
    assert tokenizer.encode(NLA_MARKER, add_special_tokens=False) == [marker.token_id]
    assert tokenizer.decode([marker.token_id]) == NLA_MARKER and marker.concept == f"<concept>{NLA_MARKER}</concept>"


def test_a_character_that_merges_with_the_concept_tags_is_skipped():
    # trained on "㊙" alone and inside tags, the byte-level BPE makes it one token alone but merges it with ">" in tags
    tokenizer = train_tiny_tokenizer(texts=["㊙ <concept>㊙</concept>"] * 200 + [NLA_MARKER] * 200)
    assert len(tokenizer.encode("㊙", add_special_tokens=False)) == 1
    assert "does not appear exactly once" in marker_problem(tokenizer, "㊙")
    assert choose_marker(tokenizer).character == NLA_MARKER


def test_requested_marker_is_checked_and_named():
    tokenizer = make_nla_tokenizer()
    assert choose_marker(tokenizer, NLA_MARKER).character == NLA_MARKER
    with pytest.raises(ConfigError, match=r"nla.injection.injection_token='㊗' cannot be the marker .* encodes to 3 tokens"):
        choose_marker(tokenizer, "㊗")
    with pytest.raises(ConfigError, match=r"output.injection_token='㊗'"):
        choose_marker(tokenizer, "㊗", key="output.injection_token")


def test_a_tokenizer_without_any_candidate_says_which_key_to_set():
    with pytest.raises(ConfigError, match="keeps none of the 40 marker candidates .* set nla.injection.injection_token"):
        choose_marker(make_tokenizer())


def test_recorded_marker_is_checked_against_the_tokenizer(tmp_path):
    tokenizer = make_nla_tokenizer()
    marker = choose_marker(tokenizer)
    path = str(tmp_path / "rows.parquet")
    write_parquet([{"a": 1}], path, metadata=marker_metadata(marker))
    assert recorded_marker(path) == marker
    check_recorded_marker(path, marker)
    with pytest.raises(DatasetError, match=r"written with marker '囍' \(token id \d+\), but the tokenizer now gives '㊗'"):
        check_recorded_marker(path, Marker("㊗", 5))
    unrecorded = str(tmp_path / "fork.parquet")
    write_parquet([{"a": 1}], unrecorded)
    assert recorded_marker(unrecorded) is None
    check_recorded_marker(unrecorded, Marker("㊗", 5))  # the fork's files record nothing: the rows are checked instead
