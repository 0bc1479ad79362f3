"""The fork's string-match evaluation: scoring by hand, evaluation sets read from parquet, generation with injections."""

from dataclasses import dataclass

import pytest
import torch
from fixtures import NLA_MARKER, make_nla_tokenizer

import ember.rollout.base as rollout_base
from ember.config import load_config
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.parquet import DatasetError, write_parquet
from ember.nla.data import VectorOptions
from ember.nla.eval import (
    category_of,
    eval_metrics,
    eval_sampling,
    eval_sets,
    evaluate,
    is_word_match,
    read_eval_set,
    score_string_match,
    should_evaluate,
    write_explanations,
)
from ember.nla.marker import choose_marker
from ember.rollout.base import RolloutOutput

TEMPLATE = "Explain the following: <concept>{injection_character}</concept>\n"


def test_a_word_matches_whole_and_in_any_case():
    assert is_word_match("The colour is RED.", "red")
    assert not is_word_match("the bread was bred", "red")
    assert is_word_match("New York, of course", "new york") and not is_word_match("newyorker", "new york")


def test_category_is_the_description_before_its_first_underscore():
    assert (category_of("geo_capital_city"), category_of("capital"), category_of("")) == ("geo", "general", "general")


def test_scores_by_hand():
    responses = ["It is Paris.", "no idea", "a red apple", "RED", "blue", "sky"]  # 3 prompts × 2 generations
    metrics = score_string_match(responses, [["paris", "Lutetia"], ["red"], ["green"]], ["geo_city", "color_fruit", "color"], 2)
    assert metrics == {"accuracy": (0.5 + 1.0 + 0.0) / 3, "num_prompts": 3, "num_generations_per_prompt": 2,
                       "accuracy_geo": 0.5, "accuracy_color": 1.0, "accuracy_general": 0.0}
    with pytest.raises(ValueError, match="5 responses for 3 prompts × 2 generations"):
        score_string_match(responses[:5], [["a"], ["b"], ["c"]], ["x", "y", "z"], 2)


def test_metrics_keep_the_forks_names_and_average_the_sets():
    metrics = eval_metrics({"QA": {"accuracy": 0.5, "num_prompts": 4}, "2hop": {"accuracy": 0.25, "num_prompts": 2}}, 1.5)
    assert metrics == {"nla_eval/QA/accuracy": 0.5, "nla_eval/QA/num_prompts": 4, "nla_eval/2hop/accuracy": 0.25,
                       "nla_eval/2hop/num_prompts": 2, "nla_eval/aggregate/accuracy": 0.375,
                       "nla_eval/evaluation_time": 1.5}


def test_schedule_and_sampling_follow_the_fork():
    assert [step for step in range(1, 11) if should_evaluate(step, 4, 10)] == [1, 4, 8, 10]
    cfg = load_config(["nla_eval.num_generations_per_prompt=3"], config_name="nla_grpo_full", schema=NLATrainConfig)
    sampling = eval_sampling(cfg.nla_eval, [2], seed=7)
    assert (sampling.n, sampling.top_k, sampling.top_p, sampling.temperature, sampling.max_new_tokens) == (3, 50, 0.9, 0.7, 50)
    assert sampling.stop_token_ids == (2,) and sampling.do_sample
    assert eval_sets({}, "one.parquet") == {"default": "one.parquet"} and eval_sets({"QA": "a"}, None) == {"QA": "a"}


def eval_file(tmp_path, rows):
    return str(write_parquet(rows, tmp_path / "eval.parquet"))


def eval_row(expected, source="The capital of France is", description="geo_capital", vector=(1.0, 2.0, 3.0, 4.0)):
    return {"source_prompt": source, "activation_vector": list(vector), "expected_completions": expected,
            "description": description}


def test_eval_rows_become_prompts_with_the_marker(tmp_path):
    tokenizer = make_nla_tokenizer()
    marker = choose_marker(tokenizer)
    path = eval_file(tmp_path, [eval_row(["Paris"]), eval_row(["Rome"], source="Italy's capital"), eval_row(["x"])])
    records = read_eval_set(path, tokenizer, marker, "{source_prompt} <concept>{injection_character}</concept>",
                            VectorOptions(size=4), max_samples=2)
    assert len(records) == 2 and records[1].expected == ["Rome"] and records[1].vector.tolist() == [1.0, 2.0, 3.0, 4.0]
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Italy's capital <concept>{NLA_MARKER}</concept>"}],
                                         tokenize=False, add_generation_prompt=True)
    assert records[1].prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert records[1].prompt_ids[records[1].marker_position] == marker.token_id


def test_a_single_expected_string_is_a_list_of_one(tmp_path):
    tokenizer = make_nla_tokenizer()
    path = eval_file(tmp_path, [eval_row("Paris"), eval_row("Rome")])
    records = read_eval_set(path, tokenizer, choose_marker(tokenizer), TEMPLATE, VectorOptions(size=4))
    assert [record.expected for record in records] == [["Paris"], ["Rome"]]


@pytest.mark.parametrize("row, problem", [
    (eval_row([]), "column 'expected_completions': expected a non-empty string or list of strings"),
    (eval_row(["Paris"], vector=(1.0, 2.0)), "Activation vector dimension mismatch: expected 4, got 2"),
])
def test_bad_eval_rows_are_named(tmp_path, row, problem):
    tokenizer = make_nla_tokenizer()
    path = eval_file(tmp_path, [eval_row(["Paris"]), row])
    with pytest.raises(DatasetError, match=f"row 1, .*{problem}"):
        read_eval_set(path, tokenizer, choose_marker(tokenizer), TEMPLATE, VectorOptions(size=4))


@dataclass(frozen=True)
class RecordedInjection:
    position: int
    vector: torch.Tensor


class ScriptedRollout:
    """A rollout engine that answers with fixed texts and records what it was asked."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompts, sampling, injections=None):
        self.calls.append((prompts, sampling, injections))
        texts = self.answers[: len(prompts) * sampling.n]
        self.answers = self.answers[len(prompts) * sampling.n:]
        return [RolloutOutput(index // sampling.n, self.tokenizer.encode(text, add_special_tokens=False), [], "stop")
                for index, text in enumerate(texts)]


def test_evaluation_injects_each_prompts_vector_at_its_marker_and_scores_the_decoded_texts(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_base, "Injection", RecordedInjection, raising=False)  # the rollout side's record
    tokenizer = make_nla_tokenizer()
    marker = choose_marker(tokenizer)
    records = read_eval_set(eval_file(tmp_path, [eval_row(["Paris"]), eval_row(["red"], description="color")]),
                            tokenizer, marker, TEMPLATE, VectorOptions(size=4))
    cfg = load_config(["nla_eval.num_generations_per_prompt=2"], config_name="nla_grpo_full", schema=NLATrainConfig)
    rollout = ScriptedRollout(tokenizer, ["paris it is", "a city", "red", "the bread"])
    metrics, explanations = evaluate(rollout, {"QA": records}, eval_sampling(cfg.nla_eval, [tokenizer.eos_token_id]), tokenizer)
    ((prompts, sampling, injections),) = rollout.calls
    assert prompts == [record.prompt_ids for record in records] and sampling.n == 2
    assert [injection.position for injection in injections] == [record.marker_position for record in records]
    assert all(torch.equal(injection.vector, record.vector) for injection, record in zip(injections, records))
    assert explanations["QA"] == ["paris it is", "a city", "red", "the bread"]
    assert metrics["nla_eval/QA/accuracy"] == 0.5 and metrics["nla_eval/QA/accuracy_geo"] == 0.5
    assert metrics["nla_eval/QA/accuracy_general"] == 0.5 and metrics["nla_eval/aggregate/accuracy"] == 0.5
    assert metrics["nla_eval/evaluation_time"] >= 0
    path = write_explanations(tmp_path / "nla_eval", "QA", 3, records, explanations["QA"], 2)
    assert path == tmp_path / "nla_eval/QA/3.jsonl" and '"match_found": true' in path.read_text().splitlines()[0]


@pytest.mark.skipif(not hasattr(rollout_base, "Injection"), reason="the rollout's Injection lands with NLA's model side")
def test_embers_engine_generates_with_the_vector_injected(tmp_path):
    from fixtures import make_nla_model_dir

    from ember.inference.config import EngineConfig
    from ember.rollout.ember_rollout import EmberRollout

    model_dir = make_nla_model_dir(tmp_path)
    tokenizer = make_nla_tokenizer()
    records = read_eval_set(eval_file(tmp_path, [eval_row(["Paris"], vector=[0.5] * 64)]), tokenizer,
                            choose_marker(tokenizer), TEMPLATE, VectorOptions(size=64))
    cfg = load_config(["nla_eval.do_sample=false"], config_name="nla_grpo_full", schema=NLATrainConfig)
    rollout = EmberRollout.from_pretrained(model_dir, EngineConfig(max_model_len=128, device="cpu", dtype=torch.float32))
    metrics, explanations = evaluate(rollout, {"QA": records}, eval_sampling(cfg.nla_eval, [tokenizer.eos_token_id]), tokenizer)
    assert metrics["nla_eval/QA/num_prompts"] == 1 and len(explanations["QA"]) == 1
