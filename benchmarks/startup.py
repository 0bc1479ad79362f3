"""Launch to first step: how long `ember train` takes from the command to its first training step, and where it goes.

Each run is a fresh `python -m ember train` process on the small-model GRPO workload of `grpo_step.py` (same model
shape, prompts and reward; two steps, no validation), timed from launch to the end of its first step. The run's own
start-up line (`trainer/startup.py`: before_setup, rewards, data, roles, resume, validation) says where the time
before the first step went, and each rank's engine build times come from its log. The first run starts with
whatever caches the machine holds; later runs find the caches it filled (torch.compile's, Triton's), which is the
"warm disk" the goal is stated for.

    python benchmarks/startup.py --shape smollm2-135m --runs 3 --ember-override actor_rollout_ref.model.use_torch_compile=true
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ember.models.tiny import train_tiny_tokenizer

from common import (  # benchmarks/common.py: a script's own folder is on sys.path
    REPO_DIR, SHAPES, Workload, accelerator_available, build_model_dir, environment, format_number, git_commit,
    make_prompts, markdown_table, write_prompt_parquet, write_reward_file)
from grpo_step import ember_overrides

STARTUP_LINE = re.compile(r"start-up before the first step: ([\d.]+) s \((.*)\)")
PART = re.compile(r"(\w+) ([\d.]+) s")
ENGINES_LINE = re.compile(r"engines built on rank 0: (.*)")
PARTS = ("before_setup", "rewards", "data", "roles", "resume", "validation")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="model shape (random weights)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=128, help="tokens of every prompt")
    parser.add_argument("--response-length", type=int, default=12, help="tokens of every response")
    parser.add_argument("--runs", type=int, default=3, help="launches, one after the other")
    parser.add_argument("--ember-override", action="append", default=[], metavar="KEY=VALUE",
                        help="any other `ember train` setting (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take")
    parser.add_argument("--log-dir", default=None,
                        help="also keep each launch's whole output as DIR/run<N>.log (with PYTHONPROFILEIMPORTTIME=1 in "
                             "the environment, its imports' times)")
    parser.add_argument("--commit", default=None, help="commit to report; default: `git rev-parse --short HEAD`")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def parse_startup(log: str) -> dict[str, float]:
    """The start-up line's total and parts, and rank 0's engine build times (`engine/<role>`), in seconds."""
    found = STARTUP_LINE.search(log)
    if found is None:
        raise RuntimeError(f"no start-up line in the run's output:\n{log[-3000:]}")
    times = {"total": float(found.group(1)), **{name: float(value) for name, value in PART.findall(found.group(2))}}
    engines = ENGINES_LINE.search(log)
    if engines is not None:
        times.update({f"engine/{name}": float(value) for name, value in PART.findall(engines.group(1))})
    return times


def first_step_s(run_dir: str) -> float:
    """The first step's `timing_s/step` from the run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if "timing_s/step" in record:
                return float(record["timing_s/step"])
    raise RuntimeError(f"{run_dir}/metrics.jsonl has no timing_s/step")


def launch(overrides: list[str], run_dir: str, timeout: float, log_file: str | None = None) -> dict[str, float]:
    """One `ember train` process; its wall clock to exit, start-up parts and first step (its output kept in
    `log_file` if given)."""
    command = [sys.executable, "-m", "ember", "train", *overrides, f"trainer.default_local_dir={run_dir}"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)
    wall = time.perf_counter() - start
    log = result.stdout + result.stderr
    if log_file is not None:
        with open(log_file, "w", encoding="utf-8") as handle:
            handle.write(log)
    if result.returncode != 0:
        raise RuntimeError(f"ember train exited with {result.returncode}:\n{log[-3000:]}")
    times = parse_startup(log)
    times["first_step"] = first_step_s(run_dir)
    times["launch_to_first_step_end"] = times["total"] + times["first_step"]
    times["process_wall"] = wall
    return times


def median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def report(env: dict[str, str], shape: str, runs: list[dict[str, float]]) -> str:
    engines = sorted({key for run in runs for key in run if key.startswith("engine/")})
    columns = ["total", *PARTS, *engines, "first_step", "process_wall"]
    rows = [[str(index + 1), *(format_number(run.get(column), 2) for column in columns)]
            for index, run in enumerate(runs)]
    if len(runs) > 1:
        rows.append(["median of 2..", *(format_number(median([run.get(column) for run in runs[1:]]), 2)
                                        for column in columns)])
    header = ["run", "start-up (s)", *PARTS, *engines, "first step", "process wall"]
    lines = [f"### Launch to first step, `{shape}` · {env['device']} · commit {env['commit']} · {env['date']}", "",
             markdown_table(header, rows), "",
             "start-up: from process start to the first step (the run's own start-up line, its parts after it); "
             "engine/*: rank 0's build of each engine (inside `roles`); process wall: launch to exit (two steps, "
             "the export and shutdown included)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(prompts=args.prompts, n=args.n, prompt_length=args.prompt_length,
                        response_length=args.response_length, micro_batch=args.prompts * args.n, warmup=1, steps=1,
                        gradient_checkpointing=False)
    workload.check()
    env = environment(args.commit or git_commit(REPO_DIR))
    runs = []
    if args.log_dir is not None:
        os.makedirs(args.log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ember-startup-bench-") as work_dir:
        tokenizer = train_tiny_tokenizer()
        dtype = torch.bfloat16 if accelerator_available() else torch.float32
        model_dir = build_model_dir(args.shape, tokenizer, os.path.join(work_dir, "model"), dtype, seed=0)
        prompts = make_prompts(tokenizer, workload.prompts * workload.total_steps, workload.prompt_length, seed=0)
        data_file = write_prompt_parquet(prompts, os.path.join(work_dir, "prompts.parquet"))
        overrides = ember_overrides(workload, model_dir, data_file, write_reward_file(work_dir), "unused", 1024)
        for index in range(args.runs):
            log_file = None if args.log_dir is None else os.path.join(args.log_dir, f"run{index}.log")
            runs.append(launch(overrides + args.ember_override, os.path.join(work_dir, f"run{index}"), args.timeout,
                               log_file))
            print(f"run {index + 1}: start-up {runs[-1]['total']:.1f} s, first step {runs[-1]['first_step']:.2f} s",
                  flush=True)
    print()
    print(report(env, args.shape, runs))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"environment": env, "shape": args.shape, "runs": runs}, handle, indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
