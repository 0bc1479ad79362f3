"""Question/answer rows turned into chat rows: `{question, answer}` becomes `{messages, answer}`.

The question becomes the single user message of `messages`; every other column (the
answer included) is kept as it is, so the output can feed an RL dataset with
`data.prompt_key=messages` or any recipe that expects a chat list.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ember.data.parquet import SourceRow, check_outputs_spare_inputs, read_records, write_parquet


def question_to_chat_row(row: SourceRow) -> dict[str, Any]:
    """`row` with its `question` replaced by `messages`, a chat list holding the question as the user's turn."""
    question = row.values["question"]
    if not isinstance(question, str) or not question.strip():
        raise row.error("question", f"expected the question as a non-empty string, got {question!r:.200}")
    kept = {column: value for column, value in row.values.items() if column != "question"}
    return {"messages": [{"role": "user", "content": question}], **kept}


def preprocess_chat(input_path: str | os.PathLike, output_path: str | os.PathLike) -> Path:
    """Convert one `.jsonl` or `.parquet` file of {question, answer} rows to a parquet of chat rows (at
    another path: the input is never replaced)."""
    check_outputs_spare_inputs([output_path], [input_path])
    rows = read_records(input_path, {"question": None, "answer": None})
    return write_parquet([question_to_chat_row(row) for row in rows], output_path)
