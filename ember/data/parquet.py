"""Reading and writing row files (parquet; JSON lines for preprocess inputs) for ember's datasets.

Every row read here keeps the file it came from and its index in that file, so that any
later complaint about it (a malformed prompt, a missing ground truth) names the file, the
row and the column. Rows are never dropped silently: a bad row is a `DatasetError`, and so is
a file pyarrow cannot read (empty, truncated, not parquet, a corrupt page): every parquet read
goes through `read_parquet_schema` / `read_parquet_table`, which name the file. Files are
written as a set (`write_parquet_files`): all under temporary names first, then renamed, so a
failure leaves the files that were there before untouched; a command whose output would replace
one of its own input files is refused before it reads anything (`check_outputs_spare_inputs`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ember.errors import UserError

PathLike = str | os.PathLike


class DatasetError(UserError, ValueError):
    """A data file or one of its rows is not in the form ember expects."""


@dataclass(frozen=True)
class SourceRow:
    """One row of a data file, with where it came from."""

    file: str  # path of the file the row was read from
    row: int  # index of the row within that file, counting from 0
    values: dict[str, Any]  # column name -> value, as pyarrow or json gives it

    def error(self, column: str | None, problem: str) -> DatasetError:
        """A `DatasetError` naming this row's file, index and (unless None) `column`."""
        where = f"{self.file}, row {self.row}" + (f", column {column!r}" if column is not None else "")
        return DatasetError(f"{where}: {problem}")


def as_file_list(files: PathLike | Iterable[PathLike]) -> list[str]:
    """One path or many as a list of strings, each checked to exist."""
    paths = [os.fspath(files)] if isinstance(files, str | os.PathLike) else [os.fspath(f) for f in files]
    if not paths:
        raise DatasetError("no data files given; set data.train_files (and data.val_files) to parquet paths")
    for path in paths:
        if not os.path.isfile(path):
            raise DatasetError(f"data file not found: {path}; check data.train_files / data.val_files")
    return paths


@contextmanager
def _reading_parquet(path: str) -> Iterator[None]:
    """pyarrow's errors for an unreadable file (they do not name it) as a DatasetError that does."""
    try:
        yield
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{path} cannot be read as parquet ({error}): the file is empty, cut short, corrupt "
                           "or not parquet at all; write it again (`ember preprocess` writes ember's data files) "
                           "or name another file") from None


def read_parquet_schema(path: str) -> list[str]:
    """The column names of the parquet file at `path`."""
    with _reading_parquet(path):
        return pq.read_schema(path).names


def read_parquet_metadata(path: str) -> dict[str, str]:
    """The key-value metadata a writer stored in the parquet file at `path` (pandas' own entry left out)."""
    with _reading_parquet(path):
        stored = pq.read_schema(path).metadata or {}
    return {key.decode(): value.decode() for key, value in stored.items() if key != b"pandas"}


def read_parquet_table(path: str, columns: list[str]) -> list[dict[str, Any]]:
    """The `columns` of every row of the parquet file at `path`, as dicts."""
    with _reading_parquet(path):
        table = pq.read_table(path, columns=columns)
    try:
        return table.to_pylist()
    except UnicodeDecodeError:  # parquet does not check that a string column holds UTF-8
        raise _first_undecodable_text(path, table) from None


def _first_undecodable_text(path: str, table: pa.Table) -> DatasetError:
    """The error naming the first row and column of `table` whose text is not UTF-8."""
    for column in table.column_names:
        values = table.column(column)
        for row in range(len(values)):
            try:
                values[row].as_py()
            except UnicodeDecodeError as error:
                return SourceRow(path, row, {}).error(column, f"text that is not UTF-8 ({error}); write the file "
                                                              "again with its strings encoded as UTF-8")
    return DatasetError(f"{path} holds text that is not UTF-8; write it again with its strings encoded as UTF-8")


def check_columns(file: str, present: Iterable[str], required: Mapping[str, str | None]) -> None:
    """Raise if a column of `required` is missing; its value names the config key that chose the column."""
    present = list(present)
    for column, key in required.items():
        if column not in present:
            hint = f"; set {key} to the column that holds it" if key else ""
            raise DatasetError(
                f"{file} has no column {column!r} (columns present: {', '.join(present) or 'none'}){hint}"
            )


def read_parquet_rows(
    files: PathLike | Iterable[PathLike],
    required: Mapping[str, str | None],
    optional: Iterable[str] = (),
) -> list[SourceRow]:
    """Read the `required` and (where present) `optional` columns of parquet `files`, in order.

    `required` maps each needed column to the config key that named it (or None), so the
    error for a missing column can say what to change.
    """
    rows: list[SourceRow] = []
    for path in as_file_list(files):
        present = read_parquet_schema(path)
        check_columns(path, present, required)
        wanted = set(required) | set(optional)
        columns = [column for column in present if column in wanted]  # in the file's order
        rows.extend(SourceRow(path, index, values) for index, values in enumerate(read_parquet_table(path, columns)))
    return rows


def read_records(path: PathLike, required: Mapping[str, str | None]) -> list[SourceRow]:
    """Read every column of one `.parquet`, `.jsonl` or `.json` file (a preprocess recipe's `--input`), which must
    hold at least one row; each row must have the `required` columns."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DatasetError(f"input file not found: {path}; give --input an existing .jsonl or .parquet file")
    if path.endswith(".parquet"):
        rows = read_parquet_rows(path, required, optional=read_parquet_schema(path))
    elif path.endswith(".jsonl"):
        rows = _read_json_lines(path, required)
    elif path.endswith(".json"):
        rows = _read_json_array(path, required)
    else:
        raise DatasetError(f"{path}: unsupported file type; give a .parquet, .jsonl or .json (an array of records) file")
    if not rows:
        raise DatasetError(f"{path} holds no rows; give a file with at least one record ({', '.join(required)})")
    return rows


def _read_json_array(path: str, required: Mapping[str, str | None]) -> list[SourceRow]:
    """A .json file holding one array of records (how some releases ship, e.g. DeepScaleR)."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"{path} is not a JSON file in UTF-8 ({error}); give one JSON array of records") from None
    if not isinstance(values, list):
        raise DatasetError(f"{path} holds a JSON {type(values).__name__}; expected an array of records")
    rows = []
    for index, record in enumerate(values):
        row = SourceRow(path, index, record if isinstance(record, dict) else {})
        if not isinstance(record, dict):
            raise row.error(None, f"expected a JSON object, got {type(record).__name__}")
        for column in required:
            if column not in record:
                raise row.error(column, f"missing (keys present: {', '.join(record) or 'none'})")
        rows.append(row)
    return rows


def _read_json_lines(path: str, required: Mapping[str, str | None]) -> list[SourceRow]:
    rows = []
    with open(path, encoding="utf-8") as lines:
        try:
            numbered = list(enumerate(line for line in lines if line.strip()))
        except UnicodeDecodeError as error:
            raise DatasetError(f"{path} is not UTF-8 text ({error}); give JSON lines in UTF-8") from None
    for index, line in numbered:
        row = SourceRow(path, index, {})
        try:
            values = json.loads(line)
        except json.JSONDecodeError as error:
            raise row.error(None, f"not valid JSON ({error})") from error
        if not isinstance(values, dict):
            raise row.error(None, f"expected a JSON object per line, got {type(values).__name__}")
        for column in required:
            if column not in values:
                raise row.error(column, f"missing (keys present: {', '.join(values) or 'none'})")
        rows.append(SourceRow(path, index, values))
    return rows


def check_outputs_spare_inputs(outputs: Iterable[PathLike], inputs: Iterable[PathLike]) -> None:
    """Refuses to write any of `outputs` that is one of `inputs` (the same file, by whatever path): the
    user's source would be replaced by its conversion."""
    existing_inputs = [source for source in inputs if os.path.isfile(source)]
    for output in outputs:
        for source in existing_inputs:
            if os.path.isfile(output) and os.path.samefile(output, source):
                raise DatasetError(f"{source} is an input of this command, and its output {output} would replace it; "
                                   "write the output to another path")


def write_parquet(rows: list[dict[str, Any]], path: PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """Write `rows` (dicts with the same keys) to a parquet file, creating its folder; returns the path."""
    (written,) = write_parquet_files({path: rows}, metadata)
    return written


def write_parquet_files(files: Mapping[PathLike, list[dict[str, Any]]],
                        metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Write each path's rows to a parquet file, all or none: every file goes to a temporary name
    beside its final one, and only once all are written are they renamed into place. On any
    failure the temporaries are removed and the files already at those paths stay as they were.
    `metadata` is stored in every file's schema (`read_parquet_metadata` reads it back)."""
    paths = {Path(path): rows for path, rows in files.items()}
    for path, rows in paths.items():
        if not rows:
            raise DatasetError(f"refusing to write {path}: no rows")
    temporaries: dict[Path, Path] = {}
    try:
        for path, rows in paths.items():
            _make_folder(path.parent)
            temporaries[path] = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            table = pa.Table.from_pylist(rows)
            if metadata:
                table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
            pq.write_table(table, temporaries[path])
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    finally:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)
    return list(paths)


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatasetError(f"cannot create the output folder {folder} ({error.strerror}); "
                           "choose an output path inside a folder you can write") from None
