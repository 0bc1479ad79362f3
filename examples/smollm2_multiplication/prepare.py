"""Prepare GRPO with a calculator on three-digit multiplication for SmolLM2-135M-Instruct: the GGUF release
(`fetch-models.sh DIR smollm2`) as a plain Hugging Face folder, and the task as parquet, each question asked
with the calculator at hand (a system prompt saying how to call it and one worked exchange through it:
`ember.data.preprocess.synthetic.calculator_prompt`).

    python examples/smollm2_multiplication/prepare.py GGUF_FILE OUT_DIR
"""

from __future__ import annotations

import os
import sys

from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_splits, with_calculator
from ember.models.gguf import save_gguf_as_hf


def write_task(out_dir: str, train_size: int = 4000, test_size: int = 256) -> None:
    splits = make_arithmetic_splits("mul", train_size=train_size, test_size=test_size, seed=0, digits=3)
    for split, rows in splits.items():
        write_parquet([with_calculator(row) for row in rows], os.path.join(out_dir, f"{split}.parquet"))


def main() -> None:
    gguf_file, out_dir = sys.argv[1], sys.argv[2]
    save_gguf_as_hf(gguf_file, os.path.join(out_dir, "model"))
    write_task(out_dir)


if __name__ == "__main__":
    main()
