"""SFTDataset's three forms, loss masks checked by decoding, truncation, row errors, and collate_sft."""

from __future__ import annotations

import pytest
import torch
from fixtures import make_tokenizer

from ember.data.parquet import DatasetError, write_parquet
from ember.data.sft_dataset import SFTDataset, SFTExample, collate_sft

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 = 6\n#### 6"},
]


def masked_runs(tokenizer, example):
    """The decoded text of each maximal run of loss-masked tokens."""
    runs, current = [], []
    for token, in_loss in zip(example.input_ids, example.loss_mask):
        if in_loss:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def write(tmp_path, rows, name="sft.parquet"):
    return str(write_parquet(rows, tmp_path / name))


def test_messages_form_masks_only_assistant_turns(tmp_path):
    tokenizer = make_tokenizer()
    dataset = SFTDataset(write(tmp_path, [{"messages": CONVERSATION}]), tokenizer, max_length=200)
    example = dataset[0]
    assert dataset.form == "messages"
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert example.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert masked_runs(tokenizer, example) == ["4<|im_end|>", "3 + 3 = 6\n#### 6<|im_end|>"]


def test_prompt_response_form_masks_response_and_eos(tmp_path):
    tokenizer = make_tokenizer()
    path = write(tmp_path, [{"prompt": "What is 2 + 2?", "response": "2 + 2 = 4\n#### 4"}])
    example = SFTDataset(path, tokenizer, max_length=200)[0]
    prompt_text = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert example.input_ids[: len(prompt_ids)] == prompt_ids
    assert example.loss_mask[: len(prompt_ids)] == [0] * len(prompt_ids)
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert masked_runs(tokenizer, example) == ["2 + 2 = 4\n#### 4<|im_end|>"]


def test_prompt_response_form_accepts_a_chat_prompt(tmp_path):
    tokenizer = make_tokenizer()
    chat_prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    example = SFTDataset(write(tmp_path, [{"prompt": chat_prompt, "response": "Hello"}]), tokenizer, 200)[0]
    assert tokenizer.decode(example.input_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>"
    )
    assert masked_runs(tokenizer, example) == ["Hello<|im_end|>"]


def test_tokenized_form_uses_labels_and_drops_padding(tmp_path):
    rows = [
        {
            "input_ids": [5, 6, 7, 8, 9, 0, 0],
            "attention_mask": [1, 1, 1, 1, 1, 0, 0],
            "labels": [-100, -100, 7, 8, 9, -100, -100],
        },
        {"input_ids": [11, 12], "attention_mask": [1, 1], "labels": [11, -100]},
    ]
    dataset = SFTDataset(write(tmp_path, rows), make_tokenizer(), max_length=10)
    assert dataset.form == "tokenized"
    assert dataset[0] == SFTExample([5, 6, 7, 8, 9], [0, 0, 1, 1, 1])
    assert dataset[1] == SFTExample([11, 12], [1, 0])


def test_tokenized_form_rejects_shifted_labels_and_length_mismatch(tmp_path):
    shifted = write(tmp_path, [{"input_ids": [5, 6, 7], "labels": [6, 7, -100]}], "shifted.parquet")
    with pytest.raises(DatasetError, match=r"shifted.parquet, row 0, column 'labels': labels\[0\]=6 is neither"):
        SFTDataset(shifted, make_tokenizer(), max_length=10)
    short_rows = [{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [5, 6, 7], "labels": [5, 6]}]
    short = write(tmp_path, short_rows, "short.parquet")
    with pytest.raises(DatasetError, match=r"short.parquet, row 1, column 'labels': has 2 entries but input_ids has 3"):
        SFTDataset(short, make_tokenizer(), max_length=10)


def test_form_detection_and_explicit_form(tmp_path):
    both = write(tmp_path, [{"messages": CONVERSATION, "prompt": "p", "response": "r"}])
    assert SFTDataset(both, make_tokenizer(), 200).form == "messages"
    assert SFTDataset(both, make_tokenizer(), 200, form="prompt_response").form == "prompt_response"
    unknown = write(tmp_path, [{"question": "q", "answer": "a"}], "unknown.parquet")
    with pytest.raises(DatasetError, match=r"unknown.parquet: cannot tell the SFT data form.*question, answer"):
        SFTDataset(unknown, make_tokenizer(), 200)
    with pytest.raises(DatasetError, match="no column 'response'.*data.response_key"):
        SFTDataset(unknown, make_tokenizer(), 200, form="prompt_response", prompt_key="question")


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_cuts_ids_and_mask_together(tmp_path, side):
    tokenizer = make_tokenizer()
    path = write(tmp_path, [{"messages": CONVERSATION}])
    full = SFTDataset(path, tokenizer, max_length=200)[0]
    cut = SFTDataset(path, tokenizer, max_length=10, truncation=side)[0]
    kept = slice(-10, None) if side == "left" else slice(0, 10)
    assert cut == SFTExample(full.input_ids[kept], full.loss_mask[kept])


def test_overlong_sequence_error_names_row_length_limit_and_keys(tmp_path):
    tokenizer = make_tokenizer()
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    path = write(tmp_path, [{"messages": short}, {"messages": CONVERSATION}])
    length = len(SFTDataset(path, tokenizer, max_length=200)[1].input_ids)
    with pytest.raises(DatasetError) as error:
        SFTDataset(path, tokenizer, max_length=20)
    message = str(error.value)
    assert f"{path}, row 1, column 'messages'" in message
    assert f"{length} tokens" in message and "data.max_length=20" in message and "data.truncation" in message


def test_malformed_rows_name_file_row_and_column(tmp_path):
    tokenizer = make_tokenizer()
    no_assistant = write(tmp_path, [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}], "a.parquet")
    with pytest.raises(DatasetError, match=r"a.parquet, row 1, column 'messages': no assistant message"):
        SFTDataset(no_assistant, tokenizer, 200)
    missing_rows = [{"prompt": "p", "response": "r"}, {"prompt": "p", "response": None}]
    missing_response = write(tmp_path, missing_rows, "b.parquet")
    with pytest.raises(DatasetError, match=r"b.parquet, row 1, column 'response': expected the response as a string"):
        SFTDataset(missing_response, tokenizer, 200)
    assistant_first = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}]
    with pytest.raises(DatasetError, match=r"d.parquet, row 0, column 'messages': starts with an assistant"):
        SFTDataset(write(tmp_path, [{"messages": assistant_first}], "d.parquet"), tokenizer, 200)
    bad_role = write(tmp_path, [{"messages": [{"role": 3, "content": "x"}]}], "c.parquet")
    with pytest.raises(DatasetError, match=r"c.parquet, row 0, column 'messages': message 0"):
        SFTDataset(bad_role, tokenizer, 200)


def test_collate_pads_right_and_sets_labels_from_the_mask():
    batch = collate_sft([SFTExample([1, 2, 3], [0, 1, 1]), SFTExample([4, 5], [1, 0])], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert all(tensor.dtype == torch.long for tensor in batch.values())


TOOLS_TEMPLATE = ("{% if tools %}tools: {% for tool in tools %}{{ tool.name }} {% endfor %}\n{% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("tools", [[{"name": "calculator", "description": "adds"}],
                                   '[{"name": "calculator", "description": "adds"}]'])
def test_a_rows_tools_reach_the_chat_template(tmp_path, tools):
    """`data.multiturn.tools_key`: tool schemas (a list, or its JSON text) go to the template as `tools`."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    path = write(tmp_path, [{"messages": messages, "tools": tools}, {"messages": messages, "tools": None}])
    with_tools, without = SFTDataset(path, tokenizer, max_length=200, form="messages")
    assert tokenizer.decode(with_tools.input_ids).startswith("tools: calculator")
    assert "tools" not in tokenizer.decode(without.input_ids)
    assert masked_runs(tokenizer, with_tools) == masked_runs(tokenizer, without)  # the loss stays on the answer
    bad = write(tmp_path, [{"messages": messages, "tools": "not json"}], name="bad.parquet")
    with pytest.raises(DatasetError, match="tools.*is text but not JSON"):
        SFTDataset(bad, tokenizer, max_length=200, form="messages")


def test_truncated_rows_are_counted_and_rows_left_without_a_target_named(tmp_path, caplog):
    """Truncation changes rows: the dataset says how many, and which rows it left with no token to train on
    (they would cost a batch slot and train on nothing)."""
    import logging

    tokenizer = make_tokenizer()
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    path = write(tmp_path, [{"messages": short}, {"messages": CONVERSATION}, {"messages": CONVERSATION}])
    with caplog.at_level(logging.WARNING, logger="ember.data"):
        dataset = SFTDataset(path, tokenizer, max_length=3, truncation="right")
    assert len(dataset) == 3 and sum(dataset[1].loss_mask) == 0  # rows stay; what they lost is reported
    assert "data.truncation=right cut 3 of 3 rows to data.max_length=3" in caplog.text
    assert "rows 0, 1, 2 keep no token to train on" in caplog.text


def test_max_samples_keeps_the_first_rows_as_verls_sft_dataset_does(tmp_path):
    tokenizer = make_tokenizer()
    rows = [{"prompt": f"What is {i} + 1?", "response": f"#### {i + 1}"} for i in range(5)]
    path = write(tmp_path, rows)
    kept = SFTDataset(path, tokenizer, max_length=200, max_samples=2)
    assert len(kept) == 2
    assert [example.input_ids for example in kept] == [example.input_ids for example in SFTDataset(path, tokenizer, 200)][:2]
    assert len(SFTDataset(path, tokenizer, max_length=200, max_samples=-1)) == 5
    assert len(SFTDataset(path, tokenizer, max_length=200, max_samples=9)) == 5
