"""Competition-math releases that siiRL and verl scripts train on, turned into RL rows.

- `math`: MATH-style records (`problem`, `solution` whose last `\\boxed{...}` is the answer),
  as the MATH release and its Hugging Face copy (lighteval) store them, one file per split.
  Rows get verl's data source `DigitalLearningGmbH/MATH-lighteval`.
- `deepscaler`: DeepScaleR's records (`problem`, `answer`, optional `solution`), one JSON
  array (the release's `deepscaler.json`), jsonl or parquet; a training set only. Rows get the
  data source `deepscaler`.

Both route to the math scorer (math-verify: the last boxed answer of a response against the
ground truth) and ask for the answer in `\\boxed{}` as verl's recipes do. A record without an
answer is an error naming its file and row, never skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ember.data.parquet import SourceRow, check_outputs_spare_inputs, read_records, write_parquet_files
from ember.data.preprocess.release import convert_release
from ember.rewards.extraction import last_boxed_content

MATH_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
DEEPSCALER_DATA_SOURCE = "deepscaler"
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _text(row: SourceRow, column: str) -> str:
    value = row.values.get(column)
    if not isinstance(value, str) or not value.strip():
        raise row.error(column, f"expected non-empty text, got {value!r:.200}")
    return value


def _rl_row(data_source: str, problem: str, answer: str, extra_info: dict[str, Any]) -> dict[str, Any]:
    return {"data_source": data_source,
            "prompt": [{"role": "user", "content": f"{problem} {BOXED_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": extra_info}


def math_rl_row(row: SourceRow, split: str, index: int) -> dict[str, Any]:
    """The RL row of one MATH record; the ground truth is the solution's last boxed answer."""
    problem, solution = _text(row, "problem"), _text(row, "solution")
    answer = last_boxed_content(solution)
    if not answer:
        raise row.error("solution", f"no \\boxed{{...}} answer in {solution[-200:]!r}")
    extra = {"split": split, "index": index, "solution": solution}
    extra.update({key: row.values[key] for key in ("level", "type") if isinstance(row.values.get(key), str)})
    return _rl_row(MATH_DATA_SOURCE, problem, answer, extra)


def deepscaler_rl_row(row: SourceRow, index: int) -> dict[str, Any]:
    """The RL row of one DeepScaleR record (its `answer` is the ground truth)."""
    problem = _text(row, "problem")
    answer = row.values.get("answer")
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise row.error("answer", f"expected the final answer as text, got {answer!r:.200}")
    solution = row.values.get("solution")
    extra = {"split": "train", "index": index, **({"solution": solution} if isinstance(solution, str) else {})}
    return _rl_row(DEEPSCALER_DATA_SOURCE, problem, answer.strip(), extra)


def preprocess_math(input_path: str | os.PathLike, output_dir: str | os.PathLike,
                    split: str | None = None) -> dict[str, Path]:
    """A MATH folder (train/test files) or one file of `split` to `<split>.parquet` in `output_dir`
    (see `release.convert_release`)."""
    return convert_release(input_path, output_dir, split, "MATH", ("problem", "solution"), math_rl_row)


def preprocess_deepscaler(input_path: str | os.PathLike, output_dir: str | os.PathLike) -> dict[str, Path]:
    """DeepScaleR's release file (.json array, .jsonl or .parquet) to `train.parquet` in `output_dir`."""
    output_path = Path(output_dir) / "train.parquet"
    check_outputs_spare_inputs([output_path], [input_path])
    records = read_records(input_path, {"problem": None, "answer": None})
    rows = [deepscaler_rl_row(row, index) for index, row in enumerate(records)]
    (path,) = write_parquet_files({output_path: rows})
    return {"train": path}
