"""`ember nla extract`: rows whose vectors are transformers' hidden_states[L] at the drawn token, and the _random control."""

import textwrap

import pyarrow.parquet as pq
import pytest
import torch
from fixtures import NLA_MARKER, make_nla_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember.cli import main
from ember.config import ConfigError, load_config
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.data.parquet import DatasetError, write_parquet
from ember.nla.data import NLAPromptDataset, NLASFTDataset, VectorOptions
from ember.nla.eval import read_eval_set
from ember.nla.extract import run_extract
from ember.nla.marker import choose_marker, recorded_marker

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A tiny model learns to add numbers every day.",
         "She reads a book", "We compute the value, check the result, and write it down. First, second, third."]

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_nla_model_dir(tmp_path_factory.mktemp("extract"))

@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()

def extract_cfg(tmp_path, model_dir, overrides=()):
    documents = write_parquet([{"text": text, "response": f"summary {index}"} for index, text in enumerate(TEXTS)],
                              tmp_path / "documents.parquet")
    return load_config([f"model.name={model_dir}", f"dataset.input_parquet={documents}", "dataset.text_column=text",
                        f"output.path_prefix={tmp_path}/out/rows", "sampling.parallel_batch_size=3", "device=cpu",
                        *overrides], config_name="nla_activation_dataset", schema=NLAExtractConfig)

def by_hand(hf_model, tokenizer, text, position, layer):
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer]
    return ids, hidden[0, position]

def test_rl_rows_hold_hidden_states_at_the_drawn_tokens_read_by_the_cli(tmp_path, model_dir, hf_model):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/rl.yaml").write_text(textwrap.dedent(f"""
        # @package _global_
        defaults: [/nla_activation_dataset, _self_]
        mode: rl
        model: {{name: {model_dir}, layer_index: 1, model_dtype: fp32}}
        dataset: {{input_parquet: {tmp_path}/documents.parquet, text_column: text}}
        sampling: {{activations_per_sample: 2, total_activations: null, parallel_batch_size: 3}}
        output: {{path_prefix: {tmp_path}/out/rl_train, random_variant: {{enabled: true}}}}
        device: cpu
    """))
    write_parquet([{"text": text} for text in TEXTS], tmp_path / "documents.parquet")
    assert main(["nla", "extract", "--config-path", str(tmp_path), "--config-name", "runs/rl"]) == 0
    path = tmp_path / "out/rl_train_layer1.parquet"
    rows = pq.read_table(path).to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    marker = choose_marker(tokenizer)
    assert recorded_marker(str(path)) == marker and len(rows) == 2 * len(TEXTS)
    for index, row in enumerate(rows):
        text = TEXTS[index // 2]
        position = row["source_sequence_token_index"]
        ids, expected = by_hand(hf_model, tokenizer, text, position, 1)
        assert 0 < position < len(ids)
        assert torch.allclose(torch.tensor(row["activation_vector"]), expected, atol=1e-5)
        assert row["activation_token_id"] == ids[position] and row["activation_layer"] == 1
        assert row["immediate_prefix"] == tokenizer.decode(ids[: position + 1])
        assert row["prompt"] == [{"role": "user", "content": f"Explain the following: <concept>{NLA_MARKER}</concept>\n"}]
    assert rows[0]["source_sequence_token_index"] != rows[1]["source_sequence_token_index"]
    dataset = NLAPromptDataset(str(path), tokenizer, marker, VectorOptions(size=64))  # what ember nla train reads
    assert len(dataset) == len(rows) and dataset[0].provenance["sample_uuid"] == rows[0]["sample_uuid"]

def test_control_file_donors(tmp_path, model_dir):
    run_extract(extract_cfg(tmp_path, model_dir, ["model.layer_index=-1", "output.random_variant.enabled=true",
                                                  "sampling.activations_per_sample=2"]))
    main_rows = pq.read_table(tmp_path / "out/rows_layer2.parquet").to_pylist()
    control = pq.read_table(tmp_path / "out/rows_layer2_random.parquet").to_pylist()
    by_uuid = {row["sample_uuid"]: row for row in main_rows}
    donors = [row["activation_vector_source_uuid"] for row in control]
    assert sorted(donors) == sorted(by_uuid) and len(control) == len(main_rows) == 8
    for own, row in zip(main_rows, control):
        assert row["sample_uuid"] == own["sample_uuid"] != row["activation_vector_source_uuid"]
        assert row["activation_vector"] == by_uuid[row["activation_vector_source_uuid"]]["activation_vector"]
        assert row["prompt"] == own["prompt"] and row["immediate_prefix"] == own["immediate_prefix"]
    assert all(row["activation_layer"] == 2 for row in main_rows)  # -1 is recorded as the layer it names

def test_sft_rows_take_the_response_column_through_the_template(tmp_path, model_dir):
    run_extract(extract_cfg(tmp_path, model_dir, ["mode=sft", "model.layer_index=1",
                                                  "response.template='{processed_response} ({source})'"]))
    rows = pq.read_table(tmp_path / "out/rows_layer1.parquet").to_pylist()
    assert [row["response"] for row in rows] == [f"summary {index} ({row['immediate_prefix']})" for index, row in enumerate(rows)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = NLASFTDataset(str(tmp_path / "out/rows_layer1.parquet"), tokenizer, choose_marker(tokenizer), VectorOptions(size=64))
    assert len(dataset) == len(TEXTS)

def test_sft_responses_from_a_summariser_on_embers_engine(tmp_path, model_dir):
    from ember.inference.config import EngineConfig
    from ember.rollout.base import SamplingParams
    from ember.rollout.ember_rollout import EmberRollout

    run_extract(extract_cfg(tmp_path, model_dir, ["mode=sft", "model.layer_index=1", "response.template='{response}'",
                                                  f"response.summarizer.model_path={model_dir}",
                                                  "response.summarizer.max_new_tokens=6", "sampling.total_activations=2"]))
    rows = pq.read_table(tmp_path / "out/rows_layer1.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": "Summarize the following text in one or two "
                                             f"sentences.\n\n{row['immediate_prefix']}"}], tokenize=False,
                                           add_generation_prompt=True) for row in rows]
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    engine = EmberRollout.from_pretrained(model_dir, EngineConfig(max_model_len=256, device="cpu", dtype=torch.float32))
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                      stop_token_ids=(tokenizer.eos_token_id,)))
    assert [row["response"] for row in rows] == [tokenizer.decode(o.token_ids, skip_special_tokens=True).strip() for o in outputs]
    assert len(rows) == 2 and all(row["response"] for row in rows)

def test_eval_rows_take_the_last_token_of_the_source_prompt(tmp_path, model_dir, hf_model):
    documents = write_parquet([{"source_prompt": "The capital of France is", "expected_completions": ["Paris"],
                                "description": "geo_capital"}], tmp_path / "eval_documents.parquet")
    run_extract(extract_cfg(tmp_path, model_dir, ["mode=eval", "model.layer_index=1", "dataset.text_column=source_prompt",
                                                  f"dataset.input_parquet={documents}"]))
    (row,) = pq.read_table(tmp_path / "out/rows_layer1.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, expected = by_hand(hf_model, tokenizer, "The capital of France is", -1, 1)
    assert row["source_sequence_token_index"] == len(ids) - 1
    assert torch.allclose(torch.tensor(row["activation_vector"]), expected, atol=1e-5)
    (record,) = read_eval_set(str(tmp_path / "out/rows_layer1.parquet"), tokenizer, choose_marker(tokenizer),
                              "Explain the following: <concept>{injection_character}</concept>\n", VectorOptions(size=64))
    assert (record.expected, record.description) == (["Paris"], "geo_capital")

def test_a_layer_outside_the_model_names_its_layer_count(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"model.layer_index=10 is outside the model: .* has 2 decoder layers, so "
                                          r"hidden_states indices run 0..2 \(0 = the embeddings, 2 = the last layer's "
                                          r"output\) or -3..-1"):
        run_extract(extract_cfg(tmp_path, model_dir))  # the fork's default layer 10

def test_existing_files_are_kept_unless_overwrite(tmp_path, model_dir):
    cfg = extract_cfg(tmp_path, model_dir, ["model.layer_index=1"])
    run_extract(cfg)
    with pytest.raises(ConfigError, match="rows_layer1.parquet exists; set output.overwrite=true"):
        run_extract(cfg)
    run_extract(extract_cfg(tmp_path, model_dir, ["model.layer_index=1", "output.overwrite=true"]))

def test_a_control_file_of_one_row_is_refused(tmp_path, model_dir):
    with pytest.raises(DatasetError, match="needs at least 2 rows"):
        run_extract(extract_cfg(tmp_path, model_dir, ["model.layer_index=1", "sampling.total_activations=1",
                                                      "output.random_variant.enabled=true"]))
    assert not (tmp_path / "out/rows_layer1.parquet").exists()  # all files or none
