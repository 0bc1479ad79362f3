"""Prepare GRPO on two-digit addition for SmolLM2-135M-Instruct on a machine without a
model hub: turn the GGUF release (see the team's MODELS.md: `fetch-models.sh DIR smollm2`)
into a plain Hugging Face directory, and write the task as parquet.

    python examples/smollm2_addition/prepare.py GGUF_FILE OUT_DIR
"""

from __future__ import annotations

import os
import sys

from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.models.gguf import save_gguf_as_hf


def main() -> None:
    gguf_file, out_dir = sys.argv[1], sys.argv[2]
    save_gguf_as_hf(gguf_file, os.path.join(out_dir, "model"))
    splits = make_arithmetic_splits("add2", train_size=4000, test_size=256, seed=0, digits=2)
    write_parquet(splits["train"], os.path.join(out_dir, "train.parquet"))
    write_parquet(splits["test"], os.path.join(out_dir, "test.parquet"))


if __name__ == "__main__":
    main()
