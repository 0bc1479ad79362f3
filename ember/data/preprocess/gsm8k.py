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

from ember.data.parquet import SourceRow
from ember.data.preprocess.release import convert_release

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


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


def preprocess_gsm8k(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, split: str | None = None
) -> dict[str, Path]:
    """Convert a GSM8K folder (every split in it) or one file (of `split`) to `<split>.parquet` in
    `output_dir` (see `release.convert_release`)."""
    return convert_release(input_path, output_dir, split, "GSM8K", ("question", "answer"), gsm8k_rl_row)
