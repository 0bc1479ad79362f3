"""SFT training throughput of ember on one device: tokens per second through ember's SFT update,
padded to the batch's longest example, padding cut per micro-batch, and packed without padding.

The engine is an `FSDPEngine` as `ember sft` builds it: role actor, fp32 master weights, bf16
compute on an accelerator (fp32 on CPU), gradient checkpointing, AdamW as the engine builds it
(fused on an accelerator). One optimizer step takes `--batch-size` examples of random token
ids, lengths uniform in [`--min-length`, `--max-length`], the loss on the second half of each
sequence, and accumulates gradients over micro-batches of `--micro-batch` examples.

Four modes run one after the other, each on a fresh engine, on the same batches:

- `padded`: `ember.trainer.sft_step.sft_update`, exactly as `ember sft` calls it. The batch is
  padded to its longest example and `Batch.split` keeps that width, so every micro-batch pays
  for the longest example of the whole batch.
- `length-sorted`: a BENCHMARK-SIDE EXPERIMENT, not ember behaviour. Each batch's examples are
  sorted longest first and each micro-batch is cut to its own longest example before the
  forward; the loss is `sft_loss` over the same batch, so the gradient is the one `padded`
  computes. Sorting alone would gain nothing, since the engine never narrows a micro-batch.
- `packed`: `use_remove_padding=True` (`training.use_rmpad`), as `ember sft` runs with it: each
  micro-batch's real tokens in one row with positions restarting per example, no padding at all.
- `packed, 16384-token micro-batches`: packing with `data.use_dynamic_bsz=True
  data.max_token_len_per_gpu=16384`: micro-batches formed by a token budget.

tokens/s counts real (non-pad) tokens and target tokens/s the tokens under the loss, each over
all timed steps; the step time is the median of `--steps` steps after `--warmup`, device
synchronised; peak memory is the allocator's peak over the mode's steps.

    python benchmarks/sft_throughput.py --shape qwen2.5-0.5b --out sft_throughput.json   # GPU
    python benchmarks/sft_throughput.py --model-dir /path/to/SmolLM2-135M                 # a real checkpoint
    python benchmarks/sft_throughput.py --shape tiny --batch-size 8 --micro-batch 4 --steps 1 --warmup 1 \\
        --max-length 64 --min-length 16                                                   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from ember.data.batch import RESPONSE, SEQUENCE, Batch
from ember.data.sft_dataset import SFTExample
from ember.distributed.device import synchronize
from ember.engines.base import MicroBatchSpec
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.models.tiny import train_tiny_tokenizer
from ember.trainer.rank_setup import compute_dtype
from ember.trainer.sft_step import sft_batch, sft_loss, sft_update

from common import (  # benchmarks/common.py: a script's own folder is on sys.path
    REPO_DIR,
    SHAPES,
    accelerator_available,
    build_model_dir,
    environment,
    format_number,
    git_commit,
    markdown_table,
    peak_memory_gib,
    release_ember,
    report_json,
    reset_peak_memory,
)

MASTER_DTYPE = "float32"  # the engine's stored and updated weights, as `ember sft` keeps them


@dataclass(frozen=True)
class SFTWorkload:
    """The shape of every optimizer step, the same in both modes."""

    batch_size: int  # examples per optimizer step
    micro_batch: int  # examples per forward/backward
    min_length: int  # shortest example, in tokens
    max_length: int  # longest example, in tokens
    warmup: int  # untimed steps per mode, run first
    steps: int  # timed steps per mode; the report gives their median step time
    compute_dtype: str  # dtype of forward and backward
    master_dtype: str  # dtype of the stored weights and the optimizer update

    def check(self) -> None:
        """Stops with a message when the workload cannot run."""
        if min(self.batch_size, self.micro_batch, self.steps) < 1 or self.warmup < 0:
            raise SystemExit("--batch-size, --micro-batch and --steps must be >= 1 and --warmup >= 0")
        if self.micro_batch > self.batch_size:
            raise SystemExit(f"--micro-batch {self.micro_batch} is larger than --batch-size {self.batch_size}")
        if not 2 <= self.min_length <= self.max_length:
            raise SystemExit(f"--min-length {self.min_length} and --max-length {self.max_length}: need "
                             "2 <= min <= max (an example needs a token before its first target)")


# --- inputs (pure) ---------------------------------------------------------------------------------


def make_sft_examples(count: int, vocab_size: int, min_length: int, max_length: int, seed: int) -> list[SFTExample]:
    """`count` examples of random ids below `vocab_size`, lengths uniform in [min_length, max_length],
    with the loss on the second half of each (the longer half when the length is odd)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        length = rng.randint(min_length, max_length)
        input_ids = [rng.randrange(vocab_size) for _ in range(length)]
        examples.append(SFTExample(input_ids, [0] * (length // 2) + [1] * (length - length // 2)))
    return examples


def target_tokens(examples: list[SFTExample]) -> int:
    """Tokens under the loss; the first token of a sequence is never one (nothing predicts it)."""
    return sum(sum(example.loss_mask[1:]) for example in examples)


# --- the benchmark-side experiment: length sorting and per-micro-batch padding (pure) --------------


def sort_by_length(examples: list[SFTExample]) -> list[SFTExample]:
    """The examples longest first (ties keep their order), so neighbours in a micro-batch have similar lengths."""
    return sorted(examples, key=lambda example: len(example.input_ids), reverse=True)


def trim_response_padding(batch: Batch) -> Batch:
    """`batch` without the response columns that are padding in every row (responses are right-padded)."""
    response_width = int(batch.attention_mask[:, batch.prompt_length:].sum(dim=1).max())
    sequence_width = batch.prompt_length + response_width
    cut = {}
    for item in dataclasses.fields(batch):
        value = getattr(batch, item.name)
        if isinstance(value, torch.Tensor) and item.metadata["layout"] in (SEQUENCE, RESPONSE):
            cut[item.name] = value[:, :sequence_width if item.metadata["layout"] == SEQUENCE else response_width]
    return dataclasses.replace(batch, **cut)


class MicroBatchTrimmedBatch(Batch):
    """Benchmark-side experiment: a Batch whose micro-batches (`split`) are each cut to their own longest row."""

    @classmethod
    def of(cls, batch: Batch) -> MicroBatchTrimmedBatch:
        return cls(**{item.name: getattr(batch, item.name) for item in dataclasses.fields(batch)})

    def split(self, size: int) -> list[Batch]:
        return [trim_response_padding(micro) for micro in super().split(size)]


def padded_positions(lengths: list[int], micro_batch: int, trimmed: bool) -> int:
    """Token positions the model runs over for one batch of sequences of `lengths`, in that order:
    each micro-batch's rows times its width, which is its own longest row when `trimmed` and the
    whole batch's longest otherwise."""
    widest = max(lengths)
    total = 0
    for start in range(0, len(lengths), micro_batch):
        chunk = lengths[start:start + micro_batch]
        total += len(chunk) * (max(chunk) if trimmed else widest)
    return total


# --- the modes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One way of running an optimizer step on a batch of examples."""

    name: str
    # One optimizer step: (engine, examples, pad token id, micro-batch size) -> the engine's metrics.
    update: Callable[[FSDPEngine, list[SFTExample], int, int], dict[str, float]]
    order: Callable[[list[SFTExample]], list[SFTExample]]  # the order the examples are micro-batched in
    trimmed: bool  # whether each micro-batch is cut to its own longest example
    packed: bool = False  # whether the engine packs each micro-batch's real tokens in one row (use_remove_padding)


def update_length_sorted(engine: FSDPEngine, examples: list[SFTExample], pad_token_id: int,
                         micro_batch: int) -> dict[str, float]:
    """`sft_update` on the examples sorted longest first, each micro-batch cut to its longest example."""
    batch = MicroBatchTrimmedBatch.of(sft_batch(sort_by_length(examples), pad_token_id))
    return engine.train_mini_batch(batch, sft_loss, micro_batch)


def update_token_budget(engine: FSDPEngine, examples: list[SFTExample], pad_token_id: int,
                        micro_batch: int) -> dict[str, float]:
    """`sft_update` with micro-batches of TOKEN_BUDGET tokens (`data.use_dynamic_bsz`) instead of a count."""
    return sft_update(engine, examples, pad_token_id, MicroBatchSpec(max_token_len=TOKEN_BUDGET))


TOKEN_BUDGET = 16384
MODES = (Mode("padded", sft_update, order=list, trimmed=False),
         Mode("length-sorted", update_length_sorted, order=sort_by_length, trimmed=True),
         Mode("packed", sft_update, order=list, trimmed=False, packed=True),
         Mode(f"packed, {TOKEN_BUDGET}-token micro-batches", update_token_budget, order=list, trimmed=False,
              packed=True))


def run_mode(mode: Mode, engine: FSDPEngine, batches: list[list[SFTExample]], pad_token_id: int,
             workload: SFTWorkload) -> dict[str, object]:
    """All batches through `mode`, the first `workload.warmup` untimed; the mode's summary."""
    reset_peak_memory()
    step_s, losses = [], []
    for index, examples in enumerate(batches):
        synchronize()
        start = time.perf_counter()
        metrics = mode.update(engine, examples, pad_token_id, workload.micro_batch)
        synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
        print(f"{mode.name} step {index + 1}/{len(batches)}: {step_s[-1]:.2f} s, loss {metrics['loss']:.4f}",
              flush=True)
    timed = batches[workload.warmup:]
    timed_s = step_s[workload.warmup:]
    tokens = sum(len(example.input_ids) for examples in timed for example in examples)
    positions = sum(sum(len(example.input_ids) for example in examples) if mode.packed else
                    padded_positions([len(example.input_ids) for example in mode.order(examples)],
                                     workload.micro_batch, mode.trimmed) for examples in timed)
    return {"mode": mode.name, "step_s": statistics.median(timed_s), "tokens_per_s": tokens / sum(timed_s),
            "target_tokens_per_s": sum(target_tokens(examples) for examples in timed) / sum(timed_s),
            "padding_fraction": 1 - tokens / positions, "tokens_per_step": tokens / len(timed),
            "peak_memory_gib": peak_memory_gib(), "loss_all": losses[workload.warmup:], "step_s_all": timed_s}


# --- the report ------------------------------------------------------------------------------------


def format_sft_report(env: dict[str, str], workload: SFTWorkload, model: str, summaries: list[dict]) -> str:
    """The environment, the workload and one row per mode, as Markdown."""
    lines = ["## SFT throughput: ember, padded vs length-sorted micro-batches", "",
             f"{env['date']} · commit {env['commit']} · {env['device']} · torch {env['torch']} · "
             f"transformers {env['transformers']} · Python {env['python']}", "",
             f"model {model} · {workload.batch_size} examples per optimizer step · "
             f"micro-batch {workload.micro_batch} · "
             f"lengths uniform in [{workload.min_length}, {workload.max_length}], loss on the second half · "
             f"{workload.compute_dtype} compute, {workload.master_dtype} master weights · gradient checkpointing · "
             f"median of {workload.steps} steps after {workload.warmup} warm-up", ""]
    rows = [[summary["mode"], format_number(summary["step_s"], 2), format_number(summary["tokens_per_s"], 0),
             format_number(summary["target_tokens_per_s"], 0), format_number(100 * summary["padding_fraction"], 1),
             format_number(summary["peak_memory_gib"], 1)] for summary in summaries]
    lines.append(markdown_table(["mode", "step (s, median)", "tokens/s", "target tokens/s", "padding (%)",
                                 "peak memory (GiB)"], rows))
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b",
                        help="model architecture (random weights, ember's tiny tokenizer)")
    parser.add_argument("--model-dir", default=None,
                        help="a Hugging Face model directory to train instead of --shape (its weights and tokenizer)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=8, help="examples per forward/backward")
    parser.add_argument("--min-length", type=int, default=64, help="shortest example, in tokens")
    parser.add_argument("--max-length", type=int, default=1024, help="longest example, in tokens")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, in each mode")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, in each mode")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the examples")
    parser.add_argument("--commit", default=None, help="commit to report; default: `git rev-parse --short HEAD`")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = SFTWorkload(batch_size=args.batch_size, micro_batch=args.micro_batch, min_length=args.min_length,
                           max_length=args.max_length, warmup=args.warmup, steps=args.steps,
                           compute_dtype=compute_dtype("auto"), master_dtype=MASTER_DTYPE)
    workload.check()
    env = environment(args.commit or git_commit(REPO_DIR))
    with tempfile.TemporaryDirectory(prefix="ember-sft-bench-") as work_dir:
        if args.model_dir:
            model_dir, model = args.model_dir, os.path.basename(os.path.normpath(args.model_dir))
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        else:
            model, tokenizer = args.shape, train_tiny_tokenizer()
            dtype = torch.bfloat16 if accelerator_available() else torch.float32
            model_dir = build_model_dir(args.shape, tokenizer, os.path.join(work_dir, "model"), dtype, args.seed)
        # As `ember sft` pads: with the pad token, or EOS where the tokenizer has none.
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        steps_per_mode = workload.warmup + workload.steps
        examples = make_sft_examples(workload.batch_size * steps_per_mode, len(tokenizer), workload.min_length,
                                     workload.max_length, args.seed)
        batches = [examples[start:start + workload.batch_size]
                   for start in range(0, len(examples), workload.batch_size)]
        summaries = []
        for mode in MODES:  # a fresh engine per mode: the same starting weights, nothing carried over
            engine = FSDPEngine(EngineOptions(model_path=model_dir, role="actor", model_dtype=MASTER_DTYPE,
                                              param_dtype=workload.compute_dtype, enable_gradient_checkpointing=True,
                                              use_remove_padding=mode.packed, seed=args.seed, optim=OptimOptions()))
            summaries.append(run_mode(mode, engine, batches, pad_token_id, workload))
            del engine
            release_ember()
    print()
    print(format_sft_report(env, workload, model, summaries))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report_json(env, workload, model, summaries), handle, indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
