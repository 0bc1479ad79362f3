"""`ember preprocess <recipe>`: the argument parser and dispatch for the data-preparation recipes.

The CLI module adds this to its `preprocess` sub-command with `build_parser(parser)` and
calls `run(args)`; each recipe's work lives in its own module as a plain function.
"""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq

from ember.data.preprocess.chat import preprocess_chat
from ember.data.preprocess.gsm8k import preprocess_gsm8k
from ember.data.preprocess.math_sets import preprocess_deepscaler, preprocess_math
from ember.data.preprocess.release import SPLITS
from ember.data.preprocess.synthetic import ARITHMETIC_TASKS, write_synthetic


def build_parser(parser: argparse.ArgumentParser) -> None:
    """Add one sub-command per recipe to the `ember preprocess` parser."""
    recipes = parser.add_subparsers(dest="recipe", required=True, metavar="RECIPE")

    gsm8k = recipes.add_parser("gsm8k", help="GSM8K (official jsonl or HF parquet) to RL parquet files")
    gsm8k.add_argument("--input", required=True, help="a folder with train/test files, or one file (then --split)")
    gsm8k.add_argument("--output-dir", required=True, help="where train.parquet / test.parquet are written")
    gsm8k.add_argument("--split", choices=SPLITS, help="the split a single input file holds")
    gsm8k.set_defaults(run_recipe=lambda args: preprocess_gsm8k(args.input, args.output_dir, args.split))

    math = recipes.add_parser("math", help="MATH-style problem/solution (\\boxed{} answers) to RL parquet files")
    math.add_argument("--input", required=True, help="a folder with train/test files, or one file (then --split)")
    math.add_argument("--output-dir", required=True, help="where train.parquet / test.parquet are written")
    math.add_argument("--split", choices=SPLITS, help="the split a single input file holds")
    math.set_defaults(run_recipe=lambda args: preprocess_math(args.input, args.output_dir, args.split))

    deepscaler = recipes.add_parser("deepscaler", help="DeepScaleR problem/answer records to an RL train.parquet")
    deepscaler.add_argument("--input", required=True, help="the release's deepscaler.json (or a .jsonl/.parquet copy)")
    deepscaler.add_argument("--output-dir", required=True, help="where train.parquet is written")
    deepscaler.set_defaults(run_recipe=lambda args: preprocess_deepscaler(args.input, args.output_dir))

    chat = recipes.add_parser("chat", help="{question, answer} rows to {messages, answer} chat rows")
    chat.add_argument("--input", required=True, help="a .jsonl or .parquet file of question/answer rows")
    chat.add_argument("--output", required=True, help="the parquet file to write")
    chat.set_defaults(run_recipe=lambda args: {"chat": preprocess_chat(args.input, args.output)})

    synthetic = recipes.add_parser("synthetic", help="built-in arithmetic tasks as RL and SFT parquet files")
    synthetic.add_argument("--task", required=True, choices=ARITHMETIC_TASKS, help="which arithmetic task")
    synthetic.add_argument("--output-dir", required=True, help="where train/test/sft.parquet are written")
    synthetic.add_argument("--train-size", type=int, default=2000, help="number of training problems")
    synthetic.add_argument("--test-size", type=int, default=200, help="number of test problems (none in train)")
    synthetic.add_argument("--seed", type=int, default=0, help="seed of the problem generator")
    synthetic.add_argument("--digits", type=int, default=2, help="digits per operand: the difficulty knob")
    synthetic.set_defaults(
        run_recipe=lambda args: write_synthetic(
            args.task, args.output_dir, args.train_size, args.test_size, args.seed, args.digits
        )
    )


def run(args: argparse.Namespace) -> int:
    """Run the recipe `args` names and print each file written with its row count; returns the exit status."""
    for name, path in args.run_recipe(args).items():
        print(f"{name}: wrote {pq.read_metadata(path).num_rows} rows to {path}")
    return 0
