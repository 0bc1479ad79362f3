"""Full fine-tuning against LoRA in one GRPO step on one GPU: peak memory, step time, update time and
weight-sync time, each row in a fresh process, in one call.

The rows train the same randomly initialised model (`--shape`, Qwen2.5-7B's by default) on the same
prompts and pseudo-random reward with ember's engine for generation (EOS ignored: every response is
`--response-length` tokens), gradient checkpointing on, one optimizer step per batch. Full fine-tuning
keeps fp32 master weights, gradients and Adam state of every weight (at 7B: about 112 GB, so the plain row
is expected to run out of memory on one 80 GB GPU; the offload row moves parameters and optimizer state
to the host between phases); LoRA rank `--lora-rank` on every linear layer (`target_modules=all-linear`)
trains only the adapters, and its weight sync sends the adapted layers, merged (`engines/lora.py`).

Each row is `python benchmarks/lora_memory.py --row NAME ...` in a subprocess (the allocator's peak is
that process's alone) running `RLTrainer.train_step` as `ember train` does. Columns, medians of the timed
steps: `step` the wall clock of a step (device synchronised), `update` ember's `timing_s/update_actor`,
`sync` the weight sync to the rollout engine (the actor engine's `named_parameters_for_sync`, from its
first bucket to the last loaded into the generation engine), and the allocator's peak over the run.

    python benchmarks/lora_memory.py --out lora_memory.json          # one GPU, Qwen2.5-7B shape
    python benchmarks/lora_memory.py --shape tiny --prompts 4 --n 2 --response-length 8 --steps 1 --warmup 1  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import (  # benchmarks/common.py: a script's own folder is on sys.path
    REPO_DIR,
    SHAPES,
    Workload,
    accelerator_available,
    build_model_dir,
    environment,
    format_number,
    git_commit,
    make_prompts,
    markdown_table,
    peak_memory_gib,
    reset_peak_memory,
    write_prompt_parquet,
    write_results,
    write_reward_file,
)
from grpo_step import ember_overrides, time_ember_steps

A = "actor_rollout_ref"
OFFLOAD = [f"{A}.actor.fsdp_config.param_offload=True", f"{A}.actor.fsdp_config.optimizer_offload=True"]


def rows(lora_rank: int) -> dict[str, list[str]]:
    """Row name -> its `ember train` overrides."""
    lora = [f"{A}.model.lora_rank={lora_rank}", f"{A}.model.lora_alpha={2 * lora_rank}",
            f"{A}.model.target_modules=all-linear", f"{A}.actor.optim.lr=1e-5"]
    return {"full fine-tuning": [], "full fine-tuning, param + optimizer offload": OFFLOAD,
            f"LoRA r={lora_rank} all-linear": lora}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b", help="model architecture (random weights)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=128, help="tokens of every prompt, chat template included")
    parser.add_argument("--response-length", type=int, default=256, help="tokens of every response")
    parser.add_argument("--micro-batch", type=int, default=8, help="responses per forward/backward in the update")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--lora-rank", type=int, default=32, help="LoRA's r (lora_alpha is 2r)")
    parser.add_argument("--only", default=None, help="run only the rows whose name contains this")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="an `ember train` override added to every row (repeatable)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one row may take")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # inside a row's process: which row
    parser.add_argument("--inputs", default=None, help=argparse.SUPPRESS)  # the row's model, data and reward (JSON)
    return parser.parse_args(argv)


def workload_of(args: argparse.Namespace) -> Workload:
    workload = Workload(prompts=args.prompts, n=args.n, prompt_length=args.prompt_length,
                        response_length=args.response_length, micro_batch=args.micro_batch, warmup=args.warmup,
                        steps=args.steps, gradient_checkpointing=True)
    workload.check()
    return workload


# --- one row, in its own process -----------------------------------------------------------------


def timed_weight_syncs(engine) -> list[float]:
    """Wraps `engine.named_parameters_for_sync` so each full pass (the consumer's loading included, as the
    generator is consumed lazily) adds its seconds to the returned list."""
    from ember.distributed.device import synchronize

    seconds: list[float] = []
    stream = engine.named_parameters_for_sync

    def timed(*args, **kwargs):
        start = time.perf_counter()
        yield from stream(*args, **kwargs)
        synchronize()
        seconds.append(time.perf_counter() - start)

    engine.named_parameters_for_sync = timed
    return seconds


def run_row(args: argparse.Namespace) -> dict:
    """The row's steps in this process, as `ember train` runs them; medians of the timed steps."""
    from ember.config import check_implemented, load_config
    from ember.trainer.rl import RLTrainer
    from ember.trainer.rl_setup import build_components

    workload, inputs = workload_of(args), json.loads(args.inputs)
    overrides = ember_overrides(workload, inputs["model_dir"], inputs["data_file"], inputs["reward_file"],
                                inputs["run_dir"], max_num_seqs=1024)
    overrides += [f"{A}.rollout.name=ember", "trainer.save_freq=-1", "trainer.test_freq=-1",
                  *rows(args.lora_rank)[args.row], *args.override]
    cfg = load_config(overrides)
    check_implemented(cfg)
    reset_peak_memory()
    trainer = RLTrainer(cfg, build_components(cfg))
    syncs = timed_weight_syncs(trainer.parts.actor.in_process().engine)
    sync_counts = []
    try:
        step_s, step_metrics = [], []
        while trainer.step < workload.total_steps:  # one step at a time: the syncs each step made
            one_s, one_metrics = time_ember_steps(trainer, trainer.step + 1)
            step_s += one_s
            step_metrics += one_metrics
            sync_counts.append(len(syncs))
    finally:
        trainer.parts.reward_manager.close()
        trainer.parts.shutdown()
        trainer.logger.close()
    timed = slice(workload.warmup, workload.total_steps)
    sync_s = [sum(syncs[start:end]) for start, end in zip([0, *sync_counts], sync_counts)][timed]
    engine = trainer.parts.actor.in_process().engine
    trained = sum(parameter.numel() for parameter in engine.module().parameters() if parameter.requires_grad)
    return {"step_s": statistics.median(step_s[timed]),
            "update_s": statistics.median(metrics["timing_s/update_actor"] for metrics in step_metrics[timed]),
            "sync_s": statistics.median(sync_s), "peak_memory_gib": peak_memory_gib(),
            "trained_parameters": trained, "steps_s": step_s}


# --- the table, in the calling process -------------------------------------------------------------


def run_in_subprocess(args: argparse.Namespace, row: str, inputs: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--row", row, "--inputs", json.dumps(inputs),
               *sys.argv[1:]]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO_DIR)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s", "wall_s": time.perf_counter() - start}
    lines = [line for line in result.stdout.splitlines() if line.startswith("ROW ")]
    if result.returncode or not lines:
        output = result.stdout + result.stderr
        reason = "out of memory" if "OutOfMemoryError" in output or "out of memory" in output else output[-1500:]
        return {"error": reason, "wall_s": time.perf_counter() - start}
    return {**json.loads(lines[-1].removeprefix("ROW ")), "wall_s": time.perf_counter() - start}


def table(results: dict[str, dict]) -> str:
    lines = []
    for name, result in results.items():
        if "error" in result:
            lines.append([name, "failed: " + result["error"].strip().splitlines()[-1][:80], "", "", "", ""])
            continue
        lines.append([name, f"{result['trained_parameters'] / 1e6:.1f} M", format_number(result["step_s"], 2),
                      format_number(result["update_s"], 2), format_number(result["sync_s"], 3),
                      format_number(result["peak_memory_gib"], 1)])
    return markdown_table(["row", "trained", "step s", "update s", "sync s", "peak GiB"], lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row is not None:
        print("ROW " + json.dumps(run_row(args)), flush=True)
        return 0
    from ember.models.tiny import train_tiny_tokenizer

    workload = workload_of(args)
    env = environment(git_commit(REPO_DIR))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ember-lora-memory-") as work_dir:
        tokenizer = train_tiny_tokenizer()
        prompts = make_prompts(tokenizer, workload.prompts * workload.total_steps, workload.prompt_length, seed=0)
        dtype = torch.bfloat16 if accelerator_available() else torch.float32
        inputs = {"model_dir": build_model_dir(args.shape, tokenizer, os.path.join(work_dir, "model"), dtype, seed=0),
                  "data_file": write_prompt_parquet(prompts, os.path.join(work_dir, "prompts.parquet")),
                  "reward_file": write_reward_file(work_dir)}
        if torch.cuda.is_available():  # the rows' processes get the whole GPU
            torch.cuda.empty_cache()
        for index, row in enumerate(rows(args.lora_rank)):
            if args.only and args.only not in row:
                continue
            results[row] = run_in_subprocess(args, row, {**inputs, "run_dir": os.path.join(work_dir, f"run-{index}")})
            print(f"{row}: {json.dumps(results[row])[:300]}", flush=True)
            write_results(args.out, {"environment": env, "shape": args.shape, "workload": vars(workload),
                                     "rows": results})
    print(f"\n### LoRA r={args.lora_rank} against full fine-tuning ({args.shape}, {workload.prompts} prompts x "
          f"{workload.n} x {workload.response_length} tokens; {env['device']}, {env['commit']}, {env['date']})\n\n"
          f"{table(results)}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
