"""Chat helpers: message checks, rendering without a template, assistant masks and their limits."""

from __future__ import annotations

import pytest
from fixtures import make_tokenizer

from ember.data.chat import check_messages, encode_chat_with_assistant_mask, render_chat
from ember.data.parquet import DatasetError, SourceRow


def test_check_messages_drops_keys_pyarrow_filled_with_none():
    row = SourceRow("f.parquet", 4, {"prompt": [{"role": "user", "content": "hi", "tool_calls": None}]})
    assert check_messages(row, "prompt") == [{"role": "user", "content": "hi"}]
    empty = SourceRow("f.parquet", 5, {"prompt": []})
    with pytest.raises(DatasetError, match=r"f.parquet, row 5, column 'prompt': expected a non-empty list"):
        check_messages(empty, "prompt")


def test_an_unknown_role_is_named_not_passed_to_the_template():
    row = SourceRow("f.parquet", 2, {"prompt": [{"role": "system", "content": "be brief"},
                                                {"role": "usr", "content": "hi"}]})
    with pytest.raises(DatasetError, match=r"f.parquet, row 2, column 'prompt': message 1 has role 'usr', which is "
                                           r"none of system, developer, user, assistant, tool"):
        check_messages(row, "prompt")


def test_render_without_chat_template_says_what_to_do():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_template_that_rewrites_history_is_an_error():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        encode_chat_with_assistant_mask(tokenizer, messages)
