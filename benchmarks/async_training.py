"""Synchronous against one-step-off-policy training (issue 33): steps per second of a generation-heavy GRPO
workload, `ember train` in a fresh process per mode on one host, the same random model, prompts and seed.

Modes, for each size k (GPUs per side; `--sizes 1 2` needs 2 and 4 GPUs):
- `sync, colocated`: the rollout beside the actor on 2k GPUs (hybrid engine, ember's default);
- `sync, own pool`: the actor on k GPUs, the rollout on k GPUs of its own (`hybrid_engine=false`), taking turns;
- `one-step-off`: the same pools, step k+1 generated while step k trains (`async_training.mode=one_step_off`);
- `fully async`: the same pools, generation running up to two steps ahead (`async_training.mode=fully_async`,
  `staleness_threshold=2`): the rollout never waits for an update it does not need.

Prints one table per response length: the median step time after the first `--warmup` steps, steps per
second against the colocated run, the generation time the update did not hide (`timing_s/wait_prev_gen`),
the weight sync's seconds and GB (seconds per GB) and the peak memory.

    python benchmarks/async_training.py --sizes 1 2 --response-length 256 1024 --out async.json
    python benchmarks/async_training.py --sizes 1 2 --response-length 1024 --fast-training   # a generation-bound step
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

from ember.models.tiny import train_tiny_tokenizer
from ember.trainer.loggers import read_jsonl_metrics

from common import FAST_TRAINING, REPO_DIR, Workload, build_model_dir, environment, format_number, git_commit, make_prompts, \
    markdown_table, write_prompt_parquet, write_results, write_reward_file
from grpo_step import ember_overrides


def modes(k: int) -> list[tuple[str, int, list[str]]]:
    """(name, GPUs of the run, overrides) of each mode at k GPUs a side."""
    own_pool = ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", f"rollout.n_gpus_per_node={k}"]
    return [(f"sync, colocated on {2 * k}", 2 * k, [f"trainer.n_gpus_per_node={2 * k}"]),
            (f"sync, own pool {k} + {k}", 2 * k, [f"trainer.n_gpus_per_node={k}", *own_pool]),
            (f"one-step-off {k} + {k}", 2 * k, [f"trainer.n_gpus_per_node={k}", *own_pool,
                                                 "async_training.mode=one_step_off"]),
            (f"fully async {k} + {k}", 2 * k, [f"trainer.n_gpus_per_node={k}", *own_pool,
                                               "async_training.mode=fully_async", "async_training.staleness_threshold=2"])]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1], help="GPUs per side")
    parser.add_argument("--response-length", type=int, nargs="+", default=[256])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--fast-training", action="store_true",
                        help="the update with ember's fastest switches (common.FAST_TRAINING), so the step is "
                             "generation's: what one-step-off can hide")
    parser.add_argument("--override", action="append", default=[], help="an override added to every run")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def run_mode(base: list[str], overrides: list[str], run_dir: str, warmup: int, timeout: float) -> dict:
    command = [sys.executable, "-m", "ember", "train", *base, f"trainer.default_local_dir={run_dir}",
               "trainer.logger=['console']", *overrides]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)
    if result.returncode:
        return {"error": (result.stdout + result.stderr)[-1500:]}
    records = [record for record in read_jsonl_metrics(os.path.join(run_dir, "metrics.jsonl"))
               if int(record["step"]) > warmup]

    def median(key: str) -> float | None:
        values = [record[key] for record in records if key in record]
        return statistics.median(values) if values else None

    memory = max((value for record in records for key, value in record.items() if key.endswith("peak_memory_gb")),
                 default=None)
    return {"step_s": median("timing_s/step"), "gen_s": median("timing_s/gen"),
            "wait_prev_gen_s": median("timing_s/wait_prev_gen"), "weight_sync_s": median("timing_s/weight_sync"),
            "weight_sync_gb": median("perf/weight_sync_gb"), "staleness_max": median("rollout/staleness/max"),
            "peak_memory_gb": memory, "wall_s": time.perf_counter() - start}


def table(rows: list[tuple[str, dict]]) -> str:
    def number(value, digits=2):
        return format_number(value, digits)
    baseline = next((result["step_s"] for _, result in rows if "error" not in result and result["step_s"]), None)
    lines = []
    for name, result in rows:
        if "error" in result:
            lines.append([name, "failed: " + result["error"].strip().splitlines()[-1][:80]] + [""] * 6)
            continue
        sync = result["weight_sync_s"]
        per_gb = sync / result["weight_sync_gb"] if sync and result["weight_sync_gb"] else None
        lines.append([name, number(result["step_s"]), number(baseline / result["step_s"] if baseline else None),
                      number(result["wait_prev_gen_s"]), number(sync, 3), number(per_gb, 3),
                      number(result["staleness_max"], 0), number(result["peak_memory_gb"], 1)])
    return markdown_table(["mode", "step s", "speed vs colocated", "wait_prev_gen s", "weight sync s", "s per GB",
                           "staleness max", "peak GiB"], lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment(git_commit(REPO_DIR))
    results = {"environment": env, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ember-async-") as work_dir:
        tokenizer = train_tiny_tokenizer()
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model_dir = build_model_dir(args.shape, tokenizer, os.path.join(work_dir, "model"), dtype, seed=0)
        reward_file = write_reward_file(work_dir)
        for length in args.response_length:
            workload = Workload(prompts=args.prompts, n=args.n, prompt_length=64, response_length=length,
                                micro_batch=8, warmup=args.warmup, steps=args.steps, gradient_checkpointing=False)
            prompts = make_prompts(tokenizer, workload.prompts * workload.total_steps, workload.prompt_length, seed=0)
            data_file = write_prompt_parquet(prompts, os.path.join(work_dir, f"prompts-{length}.parquet"))
            rows = []
            for k in args.sizes:
                for name, _, overrides in modes(k):
                    run_dir = os.path.join(work_dir, f"{length}-{len(rows)}")
                    base = ember_overrides(workload, model_dir, data_file, reward_file, run_dir, max_num_seqs=1024)
                    extra = (FAST_TRAINING if args.fast_training else []) + args.override
                    rows.append((name, run_mode(base, overrides + extra, run_dir, args.warmup, args.timeout)))
                    print(f"{length} tokens / {name}: {json.dumps(rows[-1][1])[:300]}", flush=True)
                    results["runs"][str(length)] = rows
                    write_results(args.out, results)
            print(f"\n### {args.shape}, {args.prompts} prompts x {args.n} x {length} tokens ({env['device']}, "
                  f"{env['commit']}, {env['date']})\n\n{table(rows)}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
