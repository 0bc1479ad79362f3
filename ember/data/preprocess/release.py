"""A dataset release with a file per split (train/test, jsonl or Hugging Face parquet shards)
turned into RL parquet files, the part every such recipe shares.

`convert_release` takes a release folder (every split in it) or one file of a named split,
reads each record with the recipe's required columns, turns it into a row with the recipe's
function, and writes all splits as a set only after every one converted, so a bad row in one
split leaves the files of an earlier run untouched rather than mixing the two. An output that
would replace one of the input files (`--output-dir` the release folder, holding `train.parquet`)
is refused first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.data.parquet import DatasetError, SourceRow, check_outputs_spare_inputs, read_records, write_parquet_files

SPLITS = ("train", "test")
_INPUT_SUFFIXES = (".jsonl", ".parquet")

RowFn = Callable[[SourceRow, str, int], dict[str, Any]]
"""(record, split, index within the split) -> RL row."""


def find_split_files(directory: Path, dataset: str) -> dict[str, list[Path]]:
    """The files of each split in a release folder: `train.jsonl`, or shards like `train-00000-of-00001.parquet`."""
    found: dict[str, list[Path]] = {}
    for split in SPLITS:
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


def convert_release(input_path: str | os.PathLike, output_dir: str | os.PathLike, split: str | None, dataset: str,
                    required: tuple[str, ...], row_fn: RowFn) -> dict[str, Path]:
    """`<split>.parquet` in `output_dir` for each split of the release at `input_path` (see the module
    docstring); `dataset` names the release in errors."""
    input_path = Path(input_path)
    if not input_path.exists():
        raise DatasetError(f"{dataset} input not found: {input_path}; give --input a folder or a .jsonl/.parquet file")
    if input_path.is_dir():
        if split is not None:
            raise DatasetError(f"--split applies to a single input file, but {input_path} is a folder, converted "
                               "split by split; leave --split out")
        split_files = find_split_files(input_path, dataset)
    else:
        if split not in SPLITS:
            raise DatasetError(f"give --split train or --split test for the single input file {input_path}")
        split_files = {split: [input_path]}
    output_paths = {name: Path(output_dir) / f"{name}.parquet" for name in split_files}
    check_outputs_spare_inputs(output_paths.values(), [path for files in split_files.values() for path in files])
    outputs = {}
    for split_name, files in split_files.items():
        records = [row for path in files for row in read_records(path, dict.fromkeys(required))]
        outputs[split_name] = [row_fn(row, split_name, index) for index, row in enumerate(records)]
    paths = write_parquet_files({output_paths[name]: rows for name, rows in outputs.items()})
    return dict(zip(outputs, paths))
