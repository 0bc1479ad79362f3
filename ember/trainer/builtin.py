"""`ember train` with no arguments: a complete RL run on a built-in verifiable task that
fits on a laptop CPU in minutes.

It builds a byte-level tokenizer and a small Llama-shaped model from scratch, writes
two-digit addition problems as parquet (`ember preprocess synthetic` rows), gives the model
a short supervised warm start that teaches the answer format and stops once greedy decoding
solves about a third of the problems (`trainer/warm_start.py`), then runs GRPO with ember's
own generation engine, which lifts validation accuracy by tens of points. Settings
the user passes on the command line win over the demo's; everything lands in
`trainer.default_local_dir`. This module imports no torch, so the demo's first lines print
while the libraries load.
"""

from __future__ import annotations

import os
import time

from ember.config.schema import EmberConfig
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.trainer.loggers import format_duration

TASK = "add2"
DIGITS = 2
TOKENIZER_VOCAB_SIZE = 384
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
WARM_START = dict(target_accuracy=0.3, max_steps=500, batch_size=32, lr=3e-3, warmup_steps=20, check_every=10,
                  probe_size=128, max_length=96)


def column_addition(expression: str) -> str:
    """The reply the warm start teaches: add the ones, then the tens with the carry, then
    the answer after ####. Each line is a one-digit sum, which a model this small learns in
    a few hundred steps; the final answer alone takes it thousands.

    >>> print(column_addition("59 + 63"))
    9 + 3 = 12
    5 + 6 + 1 = 12
    #### 122
    """
    a, b = (int(term) for term in expression.split(" + "))
    ones = a % 10 + b % 10
    carry = f" + {ones // 10}" if ones >= 10 else ""
    tens = a // 10 + b // 10 + ones // 10
    return f"{a % 10} + {b % 10} = {ones}\n{a // 10} + {b // 10}{carry} = {tens}\n#### {a + b}"


def prepare_task(work_dir: str, seed: int) -> dict[str, str]:
    """Writes train/test RL parquet and the SFT warm-start parquet; returns their paths."""
    splits = make_arithmetic_splits(TASK, train_size=4000, test_size=200, seed=seed, digits=DIGITS)
    return {"train": str(write_parquet(splits["train"], os.path.join(work_dir, "train.parquet"))),
            "test": str(write_parquet(splits["test"], os.path.join(work_dir, "test.parquet"))),
            "sft": str(write_parquet([sft_row(row) for row in splits["train"]], os.path.join(work_dir, "sft.parquet")))}


def sft_row(rl_row: dict) -> dict:
    """The warm-start conversation of one training problem."""
    answer = column_addition(rl_row["extra_info"]["expression"])
    return {"messages": rl_row["prompt"] + [{"role": "assistant", "content": answer}]}


def run_builtin(cfg: EmberConfig) -> int:
    """Prepares the task, the model and its warm start where `cfg` expects them, then trains."""
    start = time.monotonic()
    model_dir = cfg.actor_rollout_ref.model.path
    work_dir = os.path.dirname(model_dir)
    seed = cfg.trainer.seed
    print("ember built-in demo: a small model trained from scratch learns two-digit addition, first from "
          "examples (warm start), then from its own attempts (GRPO)\n"
          f"run directory: {cfg.trainer.default_local_dir}", flush=True)
    os.makedirs(work_dir, exist_ok=True)
    files = prepare_task(work_dir, seed)
    if (files["train"], files["test"]) != (cfg.data.train_files, cfg.data.val_files):
        raise ValueError("the built-in demo writes its own data; leave data.train_files and data.val_files unset")
    if os.path.exists(os.path.join(model_dir, "config.json")):
        print(f"warm start: reusing {model_dir}", flush=True)
    else:
        print("loading torch and transformers", flush=True)
        # Imported here, after the first lines: torch and transformers take seconds to load.
        from ember.models.tiny import build_tiny_model, train_tiny_tokenizer
        from ember.trainer.warm_start import WarmStartOptions, warm_start

        base_dir = os.path.join(work_dir, "model-init")
        tokenizer = train_tiny_tokenizer(vocab_size=TOKENIZER_VOCAB_SIZE)
        model = build_tiny_model("llama", tokenizer, out_dir=base_dir, seed=seed, **MODEL_SHAPE)
        options = WarmStartOptions(**WARM_START)
        print(f"built a {model.num_parameters() / 1e6:.1f}M-parameter Llama and a {len(tokenizer)}-token tokenizer; "
              f"warm start until greedy decoding solves {options.target_accuracy:.0%} of the problems", flush=True)
        accuracy = warm_start(base_dir, model_dir, files["sft"], seed, options)
        print(f"warm start done in {format_duration(time.monotonic() - start)}: {accuracy:.0%} solved; "
              "GRPO takes it from here", flush=True)
    from ember.trainer.rl import run_rl

    return run_rl(cfg)
