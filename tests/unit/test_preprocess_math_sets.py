"""`ember preprocess math` and `ember preprocess deepscaler` on small files in the releases'
formats: RL rows whose ground truth the built-in math scorer accepts, and bad records named."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ember.cli import main
from ember.rewards.routing import default_compute_score

MATH_RECORDS = [
    {"problem": "What is $1+1$?", "solution": "We add: $1+1=\\boxed{2}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.",
     "level": "Level 2", "type": "Prealgebra"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_math_folder_becomes_train_and_test_rows_the_math_scorer_accepts(tmp_path, capsys):
    source = tmp_path / "MATH"
    source.mkdir()
    write_jsonl(source / "train.jsonl", MATH_RECORDS)
    write_jsonl(source / "test.jsonl", MATH_RECORDS[:1])
    assert main(["preprocess", "math", "--input", str(source), "--output-dir", str(tmp_path / "out")]) == 0
    assert "train: wrote 2 rows" in capsys.readouterr().out
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["2", "\\frac{1}{2}"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert rows[1]["extra_info"]["type"] == "Prealgebra"
    truth = rows[1]["reward_model"]["ground_truth"]
    assert default_compute_score(rows[1]["data_source"], "so it is \\boxed{0.5}", truth) == 1.0
    assert default_compute_score(rows[1]["data_source"], "so it is \\boxed{2}", truth) == 0.0
    assert pq.read_table(tmp_path / "out" / "test.parquet").num_rows == 1


def test_deepscaler_json_array_becomes_a_training_set(tmp_path):
    release = tmp_path / "deepscaler.json"
    release.write_text(json.dumps([{"problem": "Compute $3 \\cdot 4$.", "answer": "12", "solution": "It is 12."},
                                   {"problem": "What is $2^3$?", "answer": 8}]))
    assert main(["preprocess", "deepscaler", "--input", str(release), "--output-dir", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["12", "8"]
    assert {row["data_source"] for row in rows} == {"deepscaler"}
    assert default_compute_score("deepscaler", "\\boxed{12}", "12") == 1.0


@pytest.mark.parametrize("recipe, records, message", [
    ("math", [{"problem": "p", "solution": "no boxed answer here"}], "row 0, column 'solution': no \\boxed{...} answer"),
    ("deepscaler", [{"problem": "p", "answer": ""}], "row 0, column 'answer': expected the final answer as text"),
])
def test_a_record_without_an_answer_is_named(tmp_path, capsys, recipe, records, message):
    source = write_jsonl(tmp_path / ("train.jsonl" if recipe == "math" else "deepscaler.jsonl"), records)
    extra = ["--split", "train"] if recipe == "math" else []
    assert main(["preprocess", recipe, "--input", str(source), "--output-dir", str(tmp_path / "out"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
