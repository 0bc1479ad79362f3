"""Preprocess recipes (gsm8k, chat, synthetic) on files written here, read back by the datasets."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from fixtures import make_tokenizer

from ember.cli import main
from ember.data.parquet import DatasetError, write_parquet
from ember.data.preprocess import command
from ember.data.preprocess.chat import preprocess_chat
from ember.data.preprocess.gsm8k import extract_final_answer, preprocess_gsm8k
from ember.data.preprocess.synthetic import (
    ARITHMETIC_TASKS,
    make_arithmetic_rows,
    make_arithmetic_splits,
    sft_row_from_rl_row,
)
from ember.data.rl_dataset import RLDataset
from ember.data.sft_dataset import SFTDataset

NATALIA = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}
THOUSAND = {"question": "What is 999 + 1?", "answer": "999 + 1 = <<999+1=1000>>1000\n#### 1,000"}
SOCRATIC = {"question": "Ignored?", "answer": "How many? ** 1\n#### 1"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="ember preprocess")
    command.build_parser(parser)
    return command.run(parser.parse_args(argv))


def test_extract_final_answer():
    assert extract_final_answer(NATALIA["answer"]) == "72"
    assert extract_final_answer("a #### 1 #### 1,234,567 ") == "1234567"
    assert extract_final_answer("no marker here") is None


def test_gsm8k_official_folder_to_rl_parquet_read_by_rl_dataset(tmp_path, capsys):
    source = tmp_path / "grade_school_math"
    source.mkdir()
    write_jsonl(source / "train.jsonl", [NATALIA, THOUSAND])
    write_jsonl(source / "test.jsonl", [THOUSAND])
    write_jsonl(source / "train_socratic.jsonl", [SOCRATIC])
    assert run_cli(["gsm8k", "--input", str(source), "--output-dir", str(tmp_path / "out")]) == 0
    assert "train: wrote 2 rows" in capsys.readouterr().out

    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": NATALIA["question"]
                + " Let's think step by step and output the final answer after \"####\".",
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": NATALIA["answer"], "question": NATALIA["question"]},
    }
    dataset = RLDataset(str(tmp_path / "out" / "train.parquet"), make_tokenizer(), max_prompt_length=1000)
    assert [sample.ground_truth for sample in dataset] == ["72", "1000"]
    assert dataset[1].extra_info["index"] == 1
    test = RLDataset(str(tmp_path / "out" / "test.parquet"), make_tokenizer(), max_prompt_length=1000)
    assert [(s.ground_truth, s.extra_info["split"]) for s in test] == [("1000", "test")]


def test_gsm8k_hugging_face_shards_and_single_file(tmp_path):
    source = tmp_path / "main"
    write_parquet([NATALIA], source / "train-00000-of-00002.parquet")
    write_parquet([THOUSAND], source / "train-00001-of-00002.parquet")
    written = preprocess_gsm8k(source, tmp_path / "out")
    assert list(written) == ["train"]
    train = pq.read_table(written["train"]).to_pylist()
    answers = [(row["reward_model"]["ground_truth"], row["extra_info"]["index"]) for row in train]
    assert answers == [("72", 0), ("1000", 1)]

    single = write_jsonl(tmp_path / "mine.jsonl", [THOUSAND])
    written = preprocess_gsm8k(single, tmp_path / "single", split="test")
    assert pq.read_table(written["test"]).to_pylist()[0]["extra_info"]["split"] == "test"
    with pytest.raises(DatasetError, match="--split train or --split test"):
        preprocess_gsm8k(single, tmp_path / "single")


def test_gsm8k_row_without_final_answer_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [NATALIA, {"question": "q", "answer": "no final answer"}])
    with pytest.raises(DatasetError, match=r"train.jsonl, row 1, column 'answer': no final answer after '####'"):
        preprocess_gsm8k(path, tmp_path / "out", split="train")
    missing = write_jsonl(tmp_path / "test.jsonl", [{"question": "q"}])
    with pytest.raises(DatasetError, match=r"test.jsonl, row 0, column 'answer': missing"):
        preprocess_gsm8k(missing, tmp_path / "out", split="test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="holds no GSM8K split files"):
        preprocess_gsm8k(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(DatasetError, match="GSM8K input not found"):
        preprocess_gsm8k(tmp_path / "nowhere", tmp_path / "out")


def test_chat_recipe_keeps_other_columns(tmp_path):
    source = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2 + 2?", "answer": "4", "level": 1}])
    assert run_cli(["chat", "--input", str(source), "--output", str(tmp_path / "chat.parquet")]) == 0
    assert pq.read_table(tmp_path / "chat.parquet").to_pylist() == [
        {"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4", "level": 1}
    ]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "", "answer": "4"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl, row 0, column 'question'"):
        preprocess_chat(bad, tmp_path / "bad.parquet")


def operands_in(text):
    return [int(number) for number in re.findall(r"\d+", text)]


@pytest.mark.parametrize("task", ARITHMETIC_TASKS)
def test_synthetic_answers_are_correct(task):
    rows = make_arithmetic_rows(task, 200, seed=3)
    assert len({row["extra_info"]["expression"] for row in rows}) == 200
    for row in rows:
        info, answer = row["extra_info"], row["reward_model"]["ground_truth"]
        assert row["data_source"] == f"ember/arithmetic/{task}"
        assert eval(info["expression"]) == int(answer) >= 0  # noqa: S307 - our own generated arithmetic
        assert operands_in(info["question"]) == operands_in(info["expression"])
        assert row["prompt"][0]["content"] == info["question"] + " Give the final answer after ####."
        assert info["answer"] == f"{info['expression']} = {answer}\n#### {answer}"


def test_synthetic_generation_is_seeded_and_prefix_stable():
    assert make_arithmetic_rows("add2", 30, seed=1)[:10] == make_arithmetic_rows("add2", 10, seed=1)
    assert make_arithmetic_rows("add2", 10, seed=1) != make_arithmetic_rows("add2", 10, seed=2)
    assert make_arithmetic_rows("add2", 1, seed=0, digits=2)[0]["extra_info"]["question"] != (
        make_arithmetic_rows("add3", 1, seed=0, digits=2)[0]["extra_info"]["question"]
    )
    for row in make_arithmetic_rows("add2", 20, seed=0, digits=3):
        assert all(100 <= operand <= 999 for operand in operands_in(row["extra_info"]["expression"]))


def test_synthetic_train_and_test_do_not_overlap():
    splits = make_arithmetic_splits("mul2x1", train_size=300, test_size=100, seed=0)
    train = {row["extra_info"]["expression"] for row in splits["train"]}
    test = {row["extra_info"]["expression"] for row in splits["test"]}
    assert (len(train), len(test)) == (300, 100) and not train & test
    assert splits["train"] == make_arithmetic_rows("mul2x1", 300, seed=0)
    assert {row["extra_info"]["split"] for row in splits["test"]} == {"test"}
    with pytest.raises(ValueError, match="too few distinct problems.*raise --digits"):
        make_arithmetic_splits("mul2x1", train_size=90, test_size=10, seed=0, digits=1)


def test_synthetic_recipe_writes_rl_and_sft_files_the_datasets_read(tmp_path, capsys):
    out = tmp_path / "add2"
    argv = ["synthetic", "--task", "add2", "--output-dir", str(out)]
    argv += ["--train-size", "40", "--test-size", "8", "--seed", "5"]
    assert run_cli(argv) == 0
    assert "sft: wrote 40 rows" in capsys.readouterr().out
    tokenizer = make_tokenizer()
    train = RLDataset(str(out / "train.parquet"), tokenizer)
    assert len(train) == 40 and len(RLDataset(str(out / "test.parquet"), tokenizer)) == 8
    sft = SFTDataset(str(out / "sft.parquet"), tokenizer, max_length=128)
    worked = train[0].extra_info["answer"]
    assert tokenizer.decode([t for t, m in zip(sft[0].input_ids, sft[0].loss_mask) if m]) == worked + "<|im_end|>"
    assert sft_row_from_rl_row(make_arithmetic_rows("add2", 1, seed=5)[0])["messages"][1]["content"] == worked


def _preprocess_error_case(case, tmp_path):
    """(arguments of `ember preprocess gsm8k`, text the error must hold) for one kind of bad input."""
    good = json.dumps(NATALIA) + "\n"
    files = {"broken_json_line": (good + '{"question": "q", "answer": \n', "broken.jsonl, row 1: not valid JSON"),
             "answer_without_marker": (json.dumps({"question": "q", "answer": "42"}) + "\n",
                                       "answer_without_marker.jsonl, row 0, column 'answer': no final answer after '####'"),
             "empty_file": ("", "empty_file.jsonl holds no rows"),
             "wrong_columns": (json.dumps({"prompt": "q", "answer": "#### 1"}) + "\n",
                               "wrong_columns.jsonl, row 0, column 'question': missing (keys present: prompt, answer)")}
    if case in files:
        text, expected = files[case]
        name = "broken.jsonl" if case == "broken_json_line" else f"{case}.jsonl"
        (tmp_path / name).write_text(text)
        return ["--input", str(tmp_path / name), "--split", "train"], expected
    if case == "missing_input":
        return ["--input", str(tmp_path / "nowhere")], f"GSM8K input not found: {tmp_path}/nowhere"
    if case == "folder_without_splits":
        (tmp_path / "notes").mkdir()
        return ["--input", str(tmp_path / "notes")], f"{tmp_path}/notes holds no GSM8K split files"
    if case == "split_with_a_folder":
        write_jsonl(tmp_path / "train.jsonl", [NATALIA])
        return (["--input", str(tmp_path), "--split", "test"],
                f"--split applies to a single input file, but {tmp_path} is a folder")
    assert case == "file_without_split"
    write_jsonl(tmp_path / "one.jsonl", [NATALIA])
    return (["--input", str(tmp_path / "one.jsonl")],
            f"give --split train or --split test for the single input file {tmp_path}/one.jsonl")


PREPROCESS_ERRORS = ("broken_json_line", "answer_without_marker", "empty_file", "wrong_columns", "missing_input",
                     "folder_without_splits", "split_with_a_folder", "file_without_split")


@pytest.mark.parametrize("case", PREPROCESS_ERRORS)
def test_preprocess_input_errors_exit_2_with_one_message(case, tmp_path, capsys):
    arguments, expected = _preprocess_error_case(case, tmp_path)
    assert main(["preprocess", "gsm8k", *arguments, "--output-dir", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and expected in captured.err and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "out").exists()


def test_preprocess_error_in_a_process_has_no_traceback(tmp_path):
    arguments, expected = _preprocess_error_case("answer_without_marker", tmp_path)
    result = subprocess.run([sys.executable, "-m", "ember", "preprocess", "gsm8k", *arguments, "--output-dir",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and expected in result.stderr and "Traceback" not in result.stderr


def test_a_failing_split_leaves_the_earlier_output_untouched(tmp_path, capsys):
    source, out = tmp_path / "gsm8k", tmp_path / "out"
    source.mkdir()
    write_jsonl(source / "train.jsonl", [NATALIA])
    write_jsonl(source / "test.jsonl", [THOUSAND])
    assert main(["preprocess", "gsm8k", "--input", str(source), "--output-dir", str(out)]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert sorted(before) == ["test.parquet", "train.parquet"]

    write_jsonl(source / "train.jsonl", [THOUSAND, NATALIA])  # a new train split that would convert
    write_jsonl(source / "test.jsonl", [{"question": "q", "answer": "no marker"}])  # and a test split that cannot
    assert main(["preprocess", "gsm8k", "--input", str(source), "--output-dir", str(out)]) == 2
    assert "test.jsonl, row 0, column 'answer'" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # old files, no temporaries


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, capsys):
    chat_source = write_parquet([{"question": "2 + 2?", "answer": "4"}], tmp_path / "qa.parquet")
    release = tmp_path / "release"
    write_parquet([NATALIA], release / "train.parquet")  # a split file named as the recipe names its output
    cases = [(["chat", "--input", str(chat_source), "--output", str(chat_source)], chat_source),
             (["chat", "--input", str(chat_source), "--output", str(tmp_path / "." / "qa.parquet")], chat_source),
             (["gsm8k", "--input", str(release), "--output-dir", str(release)], release / "train.parquet"),
             (["gsm8k", "--input", str(release / "train.parquet"), "--split", "train", "--output-dir", str(release)],
              release / "train.parquet")]
    for arguments, source in cases:
        before = source.read_bytes()
        assert main(["preprocess", *arguments]) == 2, arguments
        error = capsys.readouterr().err
        assert error.startswith("error: ") and f"{source} is an input" in error and "another" in error, error
        assert source.read_bytes() == before, arguments
