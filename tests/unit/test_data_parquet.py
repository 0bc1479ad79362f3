"""Row files: JSON lines and parquet reading with located errors, column order, writing."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures import PARQUET_CORRUPTIONS, corrupt_parquet, make_tokenizer, rl_row

from ember.data.parquet import DatasetError, read_parquet_rows, read_records, write_parquet, write_parquet_files
from ember.data.rl_dataset import RLDataset
from ember.data.sft_dataset import SFTDataset


def test_parquet_rows_keep_file_row_and_column_order(tmp_path):
    first = write_parquet([{"b": 1, "a": "x", "c": 0}], tmp_path / "one.parquet")
    second = write_parquet([{"b": 2, "a": "y"}, {"b": 3, "a": "z"}], tmp_path / "two.parquet")
    rows = read_parquet_rows([first, second], required={"a": None}, optional=["b", "missing"])
    assert [(row.file, row.row, row.values) for row in rows] == [
        (str(first), 0, {"b": 1, "a": "x"}),
        (str(second), 0, {"b": 2, "a": "y"}),
        (str(second), 1, {"b": 3, "a": "z"}),
    ]
    assert list(rows[0].values) == ["b", "a"]


def test_json_lines_errors_name_file_and_row(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "a"}\n\n{"question": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl, row 1: not valid JSON"):
        read_records(broken, {"question": None})
    listed = tmp_path / "listed.jsonl"
    listed.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match=r"listed.jsonl, row 0: expected a JSON object per line, got list"):
        read_records(listed, {})
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type"):
        read_records(other, {})


def test_records_from_parquet_keep_every_column(tmp_path):
    path = write_parquet([{"question": "q", "answer": "a", "level": 3}], tmp_path / "qa.parquet")
    assert [row.values for row in read_records(path, {"question": None})] == [
        {"question": "q", "answer": "a", "level": 3}
    ]


def test_write_parquet_refuses_no_rows_and_creates_folders(tmp_path):
    with pytest.raises(DatasetError, match="no rows"):
        write_parquet([], tmp_path / "empty.parquet")
    path = write_parquet([{"x": 1}], tmp_path / "deep" / "er" / "x.parquet")
    assert pq.read_table(path).to_pylist() == [{"x": 1}]
    with pytest.raises(DatasetError, match="no data files given"):
        read_parquet_rows([], required={})


def varied_rows(form: str, count: int = 400) -> list[dict]:
    """Rows of an RL or SFT file, varied enough that their text column is compressed in pages."""
    questions = [f"What is {index} * {index * 7 % 13} plus the {index}th prime? " * 3 for index in range(count)]
    if form == "rl":
        return [rl_row(question, str(index)) for index, question in enumerate(questions)]
    return [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(index)}]}
            for index, question in enumerate(questions)]


READERS = {"rl": lambda path: RLDataset(str(path), make_tokenizer()),
           "sft": lambda path: SFTDataset(str(path), make_tokenizer(), max_length=512)}


@pytest.mark.parametrize("form", sorted(READERS))
@pytest.mark.parametrize("corruption", PARQUET_CORRUPTIONS)
def test_an_unreadable_parquet_file_is_a_dataset_error_naming_it(corruption, form, tmp_path):
    path = write_parquet(varied_rows(form), tmp_path / f"{form}.parquet")
    READERS[form](path)  # readable before
    corrupt_parquet(path, corruption)
    with pytest.raises((pa.ArrowException, OSError)):  # pyarrow itself fails on it, without naming the file
        pq.read_table(path)
    with pytest.raises(DatasetError, match=rf"^{path} cannot be read as parquet \(.+\): the file is empty, cut short, "
                                           r"corrupt or not parquet at all; write it again \(`ember preprocess`"):
        READERS[form](path)


def test_records_must_exist_be_utf8_and_hold_rows(tmp_path):
    with pytest.raises(DatasetError, match=r"input file not found: .*nowhere.jsonl; give --input"):
        read_records(tmp_path / "nowhere.jsonl", {})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match=r"empty.jsonl holds no rows; give a file with at least one record \(question\)"):
        read_records(empty, {"question": None})
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"question": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin.jsonl is not UTF-8 text"):
        read_records(latin, {"question": None})


def test_files_are_written_as_a_set_and_a_failure_leaves_the_old_ones(tmp_path):
    old = write_parquet([{"x": "old"}], tmp_path / "out" / "train.parquet")
    old_bytes = old.read_bytes()
    (tmp_path / "blocker").write_text("a file, so no folder can be made under it")
    with pytest.raises(DatasetError, match=r"cannot create the output folder .*blocker/sub"):
        write_parquet_files({old: [{"x": "new"}], tmp_path / "blocker" / "sub" / "test.parquet": [{"x": "new"}]})
    assert old.read_bytes() == old_bytes
    assert sorted(path.name for path in old.parent.iterdir()) == ["train.parquet"]  # no temporary left
    with pytest.raises(DatasetError, match="refusing to write .*test.parquet: no rows"):
        write_parquet_files({old: [{"x": "new"}], tmp_path / "out" / "test.parquet": []})
    assert old.read_bytes() == old_bytes

    written = write_parquet_files({old: [{"x": "new"}], tmp_path / "out" / "test.parquet": [{"x": "t"}]})
    assert [pq.read_table(path).to_pylist() for path in written] == [[{"x": "new"}], [{"x": "t"}]]
    assert sorted(path.name for path in old.parent.iterdir()) == ["test.parquet", "train.parquet"]


def test_parquet_text_that_is_not_utf8_names_its_row_and_column(tmp_path):
    prompts = pa.array([b"fine", b"\xff\xfe latin-1 bytes"], pa.binary()).view(pa.string())
    path = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"id": [0, 1], "prompt": prompts}), path)
    with pytest.raises(DatasetError, match=r"bytes.parquet, row 1, column 'prompt': text that is not UTF-8"):
        read_parquet_rows(path, required={"prompt": None}, optional=["id"])
