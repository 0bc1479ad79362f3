"""RLDataset on real parquet files with the tiny tokenizer: rendering, filtering, truncation, row errors."""

from __future__ import annotations

import logging

import pytest
from fixtures import make_tokenizer, rl_row

from ember.data.parquet import DatasetError, write_parquet
from ember.data.rl_dataset import RLDataset, truncate_tokens

QUESTIONS = ["What is 2 + 3?", "Add 10 and 20.", "x" * 1 + " is " + "long " * 40, "What is 7 * 8?", "word " * 60]


def full_prompt_ids(tokenizer, question):
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def prompts_file(tmp_path):
    rows = [rl_row(q, str(i), extra_info={"split": "train", "index": i}) for i, q in enumerate(QUESTIONS)]
    return str(write_parquet(rows, tmp_path / "prompts.parquet"))


def test_prompt_rendered_with_chat_template(prompts_file):
    tokenizer = make_tokenizer()
    dataset = RLDataset(prompts_file, tokenizer, max_prompt_length=1000)
    sample = dataset[0]
    assert len(dataset) == len(QUESTIONS)
    assert sample.prompt_text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert sample.prompt_ids == tokenizer(sample.prompt_text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(sample.prompt_ids) == sample.prompt_text
    assert (sample.data_source, sample.ground_truth, sample.index) == ("test/arithmetic", "0", 0)
    assert sample.extra_info == {"split": "train", "index": 0}
    assert sample.raw_prompt is None
    assert RLDataset(prompts_file, tokenizer, max_prompt_length=1000, return_raw_chat=True)[3].raw_prompt == [
        {"role": "user", "content": "What is 7 * 8?"}
    ]


def test_chat_template_kwargs_reach_the_template(prompts_file):
    tokenizer = make_tokenizer()
    tokenizer.chat_template += (
        "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>{%- endif -%}"
    )
    plain = RLDataset(prompts_file, tokenizer, max_prompt_length=1000)
    no_thinking = RLDataset(
        prompts_file, tokenizer, max_prompt_length=1000, apply_chat_template_kwargs={"enable_thinking": False}
    )
    assert no_thinking[0].prompt_text == plain[0].prompt_text + "<think></think>"


def test_overlong_prompts_are_filtered_counted_and_logged(prompts_file, caplog):
    tokenizer = make_tokenizer()
    lengths = [len(full_prompt_ids(tokenizer, q)) for q in QUESTIONS]
    limit = 30
    assert sorted(length > limit for length in lengths) == [False, False, False, True, True]
    with caplog.at_level(logging.WARNING):
        dataset = RLDataset(prompts_file, tokenizer, max_prompt_length=limit)
    assert dataset.num_filtered_overlong == 2
    assert [sample.index for sample in dataset] == [0, 1, 3]
    assert [sample.ground_truth for sample in dataset] == ["0", "1", "3"]
    assert "dropped 2 of 5 prompts" in caplog.text


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_modes(prompts_file, side, caplog):
    tokenizer = make_tokenizer()
    full = full_prompt_ids(tokenizer, QUESTIONS[4])
    limit = 7
    expected = {"left": full[-7:], "right": full[:7], "middle": full[:3] + full[-4:]}[side]
    with caplog.at_level(logging.WARNING):
        dataset = RLDataset(
            prompts_file, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation=side
        )
    assert len(dataset) == 5 and dataset.num_filtered_overlong == 0
    cut = [i for i, q in enumerate(QUESTIONS) if len(full_prompt_ids(tokenizer, q)) > limit]
    assert dataset.truncated_rows == cut and 4 in cut
    assert f"data.truncation={side} cut {len(cut)} of 5 prompts" in caplog.text
    assert "rows " + ", ".join(map(str, cut)) in caplog.text
    assert dataset[4].prompt_ids == expected
    assert dataset[4].prompt_text == tokenizer.decode(expected)
    assert dataset[4].prompt_text.endswith("<|im_start|>assistant\n") == (side != "right")


def test_truncate_tokens_by_hand():
    assert truncate_tokens([1, 2, 3, 4, 5], 3, "left") == [3, 4, 5]
    assert truncate_tokens([1, 2, 3, 4, 5], 3, "right") == [1, 2, 3]
    assert truncate_tokens([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]
    assert truncate_tokens([1, 2], 3, "middle") == [1, 2]


def test_truncation_error_names_row_length_limit_and_keys(prompts_file):
    tokenizer = make_tokenizer()
    length = len(full_prompt_ids(tokenizer, QUESTIONS[2]))
    with pytest.raises(DatasetError) as error:
        RLDataset(prompts_file, tokenizer, max_prompt_length=30, filter_overlong_prompts=False)
    message = str(error.value)
    assert f"{prompts_file}, row 2, column 'prompt'" in message
    assert f"{length} tokens" in message and "data.max_prompt_length=30" in message
    assert "data.truncation" in message and "data.filter_overlong_prompts" in message


def test_unknown_truncation_mode_is_rejected(prompts_file):
    with pytest.raises(ValueError, match="data.truncation='sideways'"):
        RLDataset(prompts_file, make_tokenizer(), truncation="sideways")


def test_missing_column_names_file_column_and_present_columns(tmp_path):
    path = write_parquet([{"data_source": "a", "prompt": [{"role": "user", "content": "q"}]}], tmp_path / "p.parquet")
    expected = r"p.parquet has no column 'reward_model' \(columns present: data_source, prompt\)"
    with pytest.raises(DatasetError, match=expected):
        RLDataset(str(path), make_tokenizer())
    with pytest.raises(DatasetError, match="no column 'question'.*set data.prompt_key"):
        RLDataset(str(path), make_tokenizer(), prompt_key="question")


def test_prompt_that_is_not_a_message_list_is_an_error(tmp_path):
    good = write_parquet([rl_row("fine", "1")], tmp_path / "good.parquet")
    bad_rows = [rl_row("fine", "1", prompt="just text"), rl_row("x", "2", prompt="more")]
    bad = write_parquet(bad_rows, tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet, row 0, column 'prompt': expected a non-empty list"):
        RLDataset([str(good), str(bad)], make_tokenizer())


def test_message_without_content_is_an_error(tmp_path):
    rows = [rl_row("a", "1"), rl_row("b", "2"), rl_row("c", "3", prompt=[{"role": "user"}])]
    path = write_parquet(rows, tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p.parquet, row 2, column 'prompt': message 0 is not a \{role, content\}"):
        RLDataset(str(path), make_tokenizer())


def test_missing_ground_truth_is_an_error_even_for_an_overlong_row(tmp_path):
    rows = [rl_row("a", "1"), rl_row("long " * 100, "2", reward_model={"style": "rule"})]
    path = write_parquet(rows, tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p.parquet, row 1, column 'reward_model'.*ground_truth"):
        RLDataset(str(path), make_tokenizer(), max_prompt_length=20)


def test_reward_fn_key_selects_the_data_source_column_and_files_concatenate(tmp_path):
    first = write_parquet([rl_row("a", "1", origin="alpha")], tmp_path / "a.parquet")
    second = write_parquet([rl_row("b", "2", origin="beta"), rl_row("c", "3", origin="gamma")], tmp_path / "b.parquet")
    dataset = RLDataset([first, second], make_tokenizer(), reward_fn_key="origin")
    assert [sample.data_source for sample in dataset] == ["alpha", "beta", "gamma"]
    assert [sample.index for sample in dataset] == [0, 1, 2]
    assert dataset[2].ground_truth == "3"


def test_missing_file_and_all_filtered_are_errors(tmp_path, prompts_file):
    with pytest.raises(DatasetError, match="data file not found: .*nothere.parquet"):
        RLDataset(str(tmp_path / "nothere.parquet"), make_tokenizer())
    with pytest.raises(DatasetError, match="no prompts left"):
        RLDataset(prompts_file, make_tokenizer(), max_prompt_length=3)


def test_max_samples_keeps_the_rows_verl_draws_with_their_own_indices(prompts_file):
    import numpy as np

    tokenizer = make_tokenizer()
    drawn = RLDataset(prompts_file, tokenizer, max_prompt_length=1000, max_samples=3, sample_seed=7)
    expected = [int(i) for i in np.random.default_rng(7).choice(len(QUESTIONS), size=3, replace=False)]  # verl's draw
    assert [sample.index for sample in drawn] == expected
    assert [sample.ground_truth for sample in drawn] == [str(i) for i in expected]  # each row whole, as written
    assert [sample.index for sample in RLDataset(prompts_file, tokenizer, max_prompt_length=1000, max_samples=2)] == [0, 1]
    for everything in (-1, 0, len(QUESTIONS), 99):
        assert len(RLDataset(prompts_file, tokenizer, max_prompt_length=1000, max_samples=everything,
                             sample_seed=7)) == len(QUESTIONS)
    # taken before the over-long filter, as verl does: rows 2 and 4 are over 30 tokens
    filtered = RLDataset(prompts_file, tokenizer, max_prompt_length=30, filter_overlong_prompts=True, max_samples=3)
    assert [sample.index for sample in filtered] == [0, 1] and filtered.num_filtered_overlong == 1
