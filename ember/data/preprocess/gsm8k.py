"""GSM8K, as OpenAI released it (or as its Hugging Face copy stores it), turned into RL rows.

Input rows have `question` and `answer`, where the answer is a worked solution ending in
`#### N`. Each becomes a row in verl's RL format with data source `openai/gsm8k`, the
question followed by an instruction to put the final answer after "####", and ground truth
`N` with thousands separators removed. A row without `####` is an error, never skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ember.data.parquet import DatasetError, SourceRow, read_records, write_parquet_files

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SPLITS = ("train", "test")
_INPUT_SUFFIXES = (".jsonl", ".parquet")


def extract_final_answer(solution: str) -> str | None:
    """The number after the last `####` of a GSM8K solution, without commas; None if there is no `####`."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_rl_row(row: SourceRow, split: str, index: int) -> dict[str, Any]:
    """The RL row for one GSM8K record (`question`, `answer`), `index` counting within its split."""
    question, solution = row.values["question"], row.values["answer"]
    if not isinstance(question, str) or not question.strip():
        raise row.error("question", f"expected the question as a non-empty string, got {question!r:.200}")
    if not isinstance(solution, str):
        raise row.error("answer", f"expected the worked answer as a string, got {solution!r:.200}")
    final_answer = extract_final_answer(solution)
    if not final_answer:
        raise row.error("answer", f"no final answer after '####' in {solution[-200:]!r}")
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


def find_split_files(directory: Path, dataset: str = "GSM8K", splits: tuple[str, ...] = GSM8K_SPLITS
                     ) -> dict[str, list[Path]]:
    """The files of each split in a release folder: `train.jsonl`, or shards like `train-00000-of-00001.parquet`."""
    found: dict[str, list[Path]] = {}
    for split in splits:
        files = sorted(
            path
            for path in directory.iterdir()
            if path.suffix in _INPUT_SUFFIXES and (path.stem == split or path.stem.startswith(f"{split}-"))
        )
        if files:
            found[split] = files
    if not found:
        raise DatasetError(
            f"{directory} holds no {dataset} split files; expected train.jsonl / test.jsonl "
            "or train-*.parquet / test-*.parquet (the Hugging Face copy)"
        )
    return found


def preprocess_gsm8k(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, split: str | None = None
) -> dict[str, Path]:
    """Convert a GSM8K folder (every split in it) or one file (of `split`) to `<split>.parquet` in `output_dir`.

    Every split is converted before any is written, and they are written as a set, so a bad row
    in one split leaves the files of an earlier run untouched rather than mixing the two."""
    input_path = Path(input_path)
    if not input_path.exists():
        raise DatasetError(f"GSM8K input not found: {input_path}; give --input a folder or a .jsonl/.parquet file")
    if input_path.is_dir():
        if split is not None:
            raise DatasetError(f"--split applies to a single input file, but {input_path} is a folder, converted "
                               "split by split; leave --split out")
        split_files = find_split_files(input_path)
    else:
        if split not in GSM8K_SPLITS:
            raise DatasetError(f"give --split train or --split test for the single input file {input_path}")
        split_files = {split: [input_path]}
    outputs = {}
    for split_name, files in split_files.items():
        records = [row for path in files for row in read_records(path, {"question": None, "answer": None})]
        outputs[split_name] = [gsm8k_rl_row(row, split_name, index) for index, row in enumerate(records)]
    paths = write_parquet_files({Path(output_dir) / f"{name}.parquet": rows for name, rows in outputs.items()})
    return dict(zip(outputs, paths))
