"""NLA data files read into records: prompt ids with the marker's position and the vector; bad rows named."""

import math

import pytest
import torch
from fixtures import NLA_MARKER, make_nla_tokenizer, nla_rl_row

from ember.config import ConfigError, load_config
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.parquet import DatasetError, write_parquet
from ember.nla.checks import check_vector_layer
from ember.nla.data import (
    NLAPromptDataset,
    NLASFTDataset,
    VectorOptions,
    activation_layers,
    vector_options,
)
from ember.nla.marker import Marker, choose_marker, marker_metadata
from ember.nla.sft import nla_sft_batch

H = 4


@pytest.fixture(scope="module")
def tokenizer():
    return make_nla_tokenizer()


@pytest.fixture(scope="module")
def marker(tokenizer):
    return choose_marker(tokenizer)


def vector(seed):
    return [float(seed + index) for index in range(H)]


def rl_file(tmp_path, rows, name="rl.parquet", metadata=None):
    return str(write_parquet(rows, tmp_path / name, metadata=metadata))


def test_rl_records_hold_the_prompt_ids_the_marker_index_and_the_vector(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row(vector(0)), nla_rl_row(vector(1), sample_uuid="u1")])
    dataset = NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H))
    assert len(dataset) == 2
    record = dataset[1]
    text = tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True)
    assert record.prompt_text == text and record.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert record.prompt_ids[record.marker_position] == marker.token_id
    assert record.prompt_ids.count(marker.token_id) == 1
    assert record.vector.dtype == torch.float32 and record.vector.tolist() == vector(1)
    assert record.provenance["sample_uuid"] == "u1" and record.provenance["activation_layer"] == 1


@pytest.mark.parametrize("row, column, problem", [
    (nla_rl_row(vector(0)[:3]), "activation_vector", "Activation vector dimension mismatch: expected 4, got 3"),
    (nla_rl_row([]), "activation_vector", "expected the activation vector as a non-empty list of numbers"),
    (nla_rl_row([1.0, math.nan, 0.0, 0.0]), "activation_vector", "the activation vector holds NaN or infinite values"),
    (nla_rl_row(vector(0), content="Explain the following: <concept>x</concept>\n"), "prompt",
     "the prompt holds no marker <concept>囍</concept>"),
    (nla_rl_row(vector(0), content=f"<concept>{NLA_MARKER}</concept> and <concept>{NLA_MARKER}</concept>"), "prompt",
     "the prompt holds the marker '囍' 2 times"),
])
def test_a_bad_row_is_named_with_its_file_row_and_column(tmp_path, tokenizer, marker, row, column, problem):
    path = rl_file(tmp_path, [nla_rl_row(vector(0)), row])
    with pytest.raises(DatasetError) as error:
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H))
    assert f"{path}, row 1, column {column!r}: {problem}" in str(error.value)


def test_position_start_and_end_write_the_marker_where_it_is_missing(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row(vector(0), content="Explain the following:"),
                              nla_rl_row(vector(1))])
    end = NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H), position="end")
    assert end[0].messages[0]["content"] == f"Explain the following: {marker.concept}"
    assert end[1].messages[0]["content"] == nla_rl_row(vector(1))["prompt"][0]["content"]  # had one: unchanged
    start = NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H), position="start")
    assert start[0].messages[0]["content"] == f"{marker.concept} Explain the following:"
    assert start[0].prompt_ids[start[0].marker_position] == marker.token_id


def test_norm_then_scale_as_the_forks_sft(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row([3.0, 4.0, 0.0, 0.0])])
    (record,) = NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H, norm="unit", scale=2.0)).records
    assert torch.allclose(record.vector, torch.tensor([1.2, 1.6, 0.0, 0.0]))


def test_vector_options_follow_the_nla_section():
    cfg = load_config(["nla.norm=unit", "nla.scale=3"], config_name="nla_grpo_full", schema=NLATrainConfig)
    assert vector_options(cfg.nla, 896) == VectorOptions("activation_vector", 896, "unit", 3.0)
    cfg = load_config(["nla.injection.mode=project"], config_name="nla_grpo_full", schema=NLATrainConfig)
    assert vector_options(cfg.nla, 896).size is None  # project maps any length to the hidden size


def test_project_mode_takes_the_first_rows_length(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row([1.0, 2.0]), nla_rl_row([1.0, 2.0, 3.0])])
    with pytest.raises(DatasetError, match="row 1.*expected 2, got 3"):
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=None))


def test_over_long_prompts_error_or_are_cut_keeping_the_marker(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row(vector(0))])
    length = len(NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H))[0].prompt_ids)
    with pytest.raises(DatasetError, match=f"prompt has {length} tokens, more than data.max_prompt_length=5"):
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H), max_prompt_length=5)
    with pytest.raises(DatasetError, match="holds no marker"):  # cut from the left, the marker went with it
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H), max_prompt_length=5, truncation="left")


def test_data_written_for_another_marker_is_refused(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row(vector(0))], metadata=marker_metadata(Marker("㊗", 3)))
    with pytest.raises(DatasetError, match="written with marker '㊗'"):
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(size=H))


def sft_row(seed, response="A fox jumps.", content=f"Explain the following: <concept>{NLA_MARKER}</concept>\n"):
    return {**nla_rl_row(vector(seed), content=content), "response": response}


def test_sft_examples_follow_the_fork_stripped_user_turn_and_response_then_eos(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [sft_row(0), sft_row(1, response="The dog reads.")], name="sft.parquet")
    dataset = NLASFTDataset(path, tokenizer, marker, VectorOptions(size=H))
    example = dataset[1]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Explain the following: <concept>{NLA_MARKER}</concept>"}],
                                           tokenize=False, add_generation_prompt=True)
    assert example.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert example.response_ids == tokenizer("The dog reads.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example.prompt_ids[example.marker_position] == marker.token_id
    batch = nla_sft_batch(list(dataset), tokenizer.pad_token_id)
    assert batch.activation_vectors.shape == (2, H) and batch.injection_positions.tolist() == [
        dataset[0].marker_position, dataset[1].marker_position]
    targets = batch.input_ids[1, 1:][batch.response_mask[1].bool()]  # the tokens the loss counts
    assert targets.tolist() == example.response_ids


@pytest.mark.parametrize("row, column, problem", [
    (sft_row(0, response=""), "response", "expected the response as a non-empty string"),
    ({**sft_row(0), "prompt": [{"role": "system", "content": "x"}]}, "prompt", "no user message"),
])
def test_bad_sft_rows_are_named(tmp_path, tokenizer, marker, row, column, problem):
    path = rl_file(tmp_path, [sft_row(0), row], name="sft.parquet")
    with pytest.raises(DatasetError, match=f"row 1, column '{column}': {problem}"):
        NLASFTDataset(path, tokenizer, marker, VectorOptions(size=H))


def test_a_missing_column_names_the_key_that_chose_it(tmp_path, tokenizer, marker):
    path = rl_file(tmp_path, [nla_rl_row(vector(0))])
    with pytest.raises(DatasetError, match="has no column 'acts'.*set nla.activation_vector_key"):
        NLAPromptDataset(path, tokenizer, marker, VectorOptions(column="acts", size=H))


def test_recorded_layer_must_be_the_critics(tmp_path):
    path = rl_file(tmp_path, [nla_rl_row(vector(0), activation_layer=20), nla_rl_row(vector(1), activation_layer=20)])
    assert activation_layers(path) == {20}
    check_vector_layer("data.train_files", path, 20, "critic.output_layer_index")
    with pytest.raises(ConfigError, match=r"holds vectors of layer 20 .* critic.output_layer_index predicts hidden_states\[10\]"):
        check_vector_layer("data.train_files", path, 10, "critic.output_layer_index")
    bare = rl_file(tmp_path, [{"prompt": [], "activation_vector": vector(0)}], name="bare.parquet")
    check_vector_layer("data.train_files", bare, 10, "critic.output_layer_index")  # nothing recorded: nothing to check
