"""`ember train` with no arguments: a complete RL run on a built-in verifiable task that
fits on a laptop CPU in minutes.

It builds a byte-level tokenizer and a small Llama-shaped model from scratch, writes
two-digit addition problems as parquet (`ember preprocess synthetic` rows), gives the model
a short supervised warm start so it knows the answer format, then runs GRPO with ember's
own generation engine and shows validation accuracy rising. Settings the user passes on the
command line win over the demo's; everything lands in `trainer.default_local_dir`.
"""

from __future__ import annotations

import os
import time

from transformers import AutoTokenizer

from ember.config.schema import EmberConfig
from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.data.parquet import write_parquet
from ember.data.prompt_loader import PromptLoader
from ember.data.sft_dataset import SFTDataset
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.models.tiny import build_tiny_model, train_tiny_tokenizer
from ember.trainer.loggers import format_duration
from ember.trainer.sft_step import sft_update

TASK = "add2"
DIGITS = 2
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
WARM_START = dict(steps=300, batch_size=64, lr=3e-3)


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


def warm_start(model_dir: str, out_dir: str, sft_file: str, seed: int) -> None:
    """A short supervised run so the model knows the answer format, exported to `out_dir`."""
    engine = FSDPEngine(EngineOptions(
        model_path=model_dir, role="actor", model_dtype="float32", param_dtype="float32", seed=seed,
        optim=OptimOptions(lr=WARM_START["lr"], weight_decay=0.0, lr_warmup_steps=20, lr_scheduler_type="cosine",
                           total_training_steps=WARM_START["steps"], min_lr_ratio=0.1)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = SFTDataset(sft_file, tokenizer, max_length=96)
    loader = PromptLoader(dataset, WARM_START["batch_size"], shuffle=True, seed=seed)
    start, step = time.monotonic(), 0
    while step < WARM_START["steps"]:
        for examples in loader:
            step += 1
            metrics = sft_update(engine, examples, tokenizer.pad_token_id, micro_batch_size=WARM_START["batch_size"])
            if step % 25 == 0 or step == WARM_START["steps"]:
                elapsed = time.monotonic() - start
                eta = elapsed / step * (WARM_START["steps"] - step)
                print(f"warm start {step}/{WARM_START['steps']} | loss {metrics['loss']:.4f} | "
                      f"elapsed {format_duration(elapsed)} | eta {format_duration(eta)}", flush=True)
            if step >= WARM_START["steps"]:
                break
    engine.export_hf(out_dir, tokenizer=tokenizer)


def run_builtin(cfg: EmberConfig) -> int:
    """Prepares the task, the model and its warm start where `cfg` expects them, then trains."""
    from ember.trainer.rl import run_rl

    model_dir = cfg.actor_rollout_ref.model.path
    work_dir = os.path.dirname(model_dir)
    seed = cfg.trainer.seed
    print("ember built-in demo: GRPO on two-digit addition with a small model trained from scratch\n"
          f"run directory: {cfg.trainer.default_local_dir}", flush=True)
    os.makedirs(work_dir, exist_ok=True)
    files = prepare_task(work_dir, seed)
    if (files["train"], files["test"]) != (cfg.data.train_files, cfg.data.val_files):
        raise ValueError("the built-in demo writes its own data; leave data.train_files and data.val_files unset")
    base_dir = os.path.join(work_dir, "model-init")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tokenizer = train_tiny_tokenizer(vocab_size=384)
        build_tiny_model("llama", tokenizer, out_dir=base_dir, seed=seed, **MODEL_SHAPE)
        warm_start(base_dir, model_dir, files["sft"], seed)
    return run_rl(cfg)
