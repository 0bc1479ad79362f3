"""GRPO step time, ember against TRL, on one model, one workload and one machine, in one run.

Both frameworks train the same randomly initialised model (`--shape`) on the same prompts
with the same pseudo-random reward: `--prompts` prompts × `--n` responses of exactly
`--response-length` tokens (EOS ignored), gradient checkpointing (unless
`--no-gradient-checkpointing`, for both), micro-batches of
`--micro-batch` responses and one optimizer step per batch, fp32 master weights with
bf16 compute on an accelerator (fp32 on CPU). ember runs what `ember train` runs: the
config loader, `build_components` and `RLTrainer.train_step`. TRL runs `GRPOTrainer`
with transformers generation. A step is timed from the first prompt to the optimizer
step, device synchronised; the table gives the median of `--steps` steps after `--warmup`.

    python benchmarks/grpo_step.py --shape qwen2.5-0.5b --out grpo_step.json   # GPU
    python benchmarks/grpo_step.py --shape tiny --prompts 4 --n 2 --response-length 8 --steps 1 --warmup 1  # CPU smoke
    # the small-model step (SmolLM2-135M's shape, answers of 12 or 64 tokens): mostly fixed costs
    python benchmarks/grpo_step.py --shape smollm2-135m --prompts 32 --n 8 --response-length 12

ember's fastest setting in BENCHMARKS.md (the switches of `common.FAST_TRAINING`: packing in a 48k token
budget, fused log-probs, Liger's kernels; no recompute for either framework):

    python benchmarks/grpo_step.py --no-gradient-checkpointing --fast-training

TRL is imported only when it runs (`--skip-trl` leaves it out); it is not an ember
dependency: `pip install trl datasets` to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from ember.config import check_implemented, load_config
from ember.distributed.device import synchronize
from ember.models.tiny import train_tiny_tokenizer
from ember.rewards import RewardItem, resolve_reward_fn
from ember.trainer.rl import RLTrainer
from ember.trainer.rank_setup import compute_dtype
from ember.trainer.rl_setup import build_components

from common import (  # benchmarks/common.py: a script's own folder is on sys.path
    DATA_SOURCE,
    FAST_TRAINING,
    REPO_DIR,
    SHAPES,
    FrameworkResult,
    Workload,
    accelerator_available,
    allocated_memory_gib,
    build_model_dir,
    environment,
    format_report,
    git_commit,
    make_prompts,
    package_version,
    peak_memory_gib,
    release_ember,
    report_json,
    reset_peak_memory,
    write_prompt_parquet,
    write_reward_file,
)

# The phases that fill the main table's "gen" and "train" columns, per framework.
MAIN_PHASES = {"ember": ("gen", "update_actor"), "ember (Ray worker)": ("gen", "update_actor"), "trl": ("gen", "train")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b",
                        help="model architecture (random weights)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=128, help="tokens of every prompt, chat template included")
    parser.add_argument("--response-length", type=int, default=256, help="tokens of every response")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="responses per forward/backward in the update (at most the batch)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    parser.add_argument("--ember-max-num-seqs", type=int, default=1024,
                        help="ember's actor_rollout_ref.rollout.max_num_seqs: most rows per transformers generate call")
    parser.add_argument("--ember-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra ember config override, as on the `ember train` command line (repeatable)")
    parser.add_argument("--fast-training", action="store_true",
                        help="ember's fastest training switches (common.FAST_TRAINING), before any --ember-override")
    parser.add_argument("--skip-ember", action="store_true", help="do not run ember")
    parser.add_argument("--ray", action="store_true",
                        help="also run ember with its roles in one Ray worker (the multi-GPU path), to time Ray's cost")
    parser.add_argument("--ray-first", action="store_true",
                        help="with --ray, run the Ray worker before the in-process run (to tell Ray's cost from an order effect)")
    parser.add_argument("--skip-trl", action="store_true", help="do not run TRL (and do not import it)")
    parser.add_argument("--commit", default=None, help="commit to report; default: `git rev-parse --short HEAD`")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile ember's last step (global_profiler): each process's trace, top operators and "
                             "phase table (wall, device busy and idle time per phase) under DIR/<run>/step_N")
    parser.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                        help="both frameworks keep activations instead of recomputing them (more memory, less work)")
    return parser.parse_args(argv)


# --- ember -----------------------------------------------------------------------------------------


def ember_overrides(workload: Workload, model_dir: str, data_file: str, reward_file: str, run_dir: str,
                    max_num_seqs: int) -> list[str]:
    """The `ember train` command line of the workload."""
    return [f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={workload.gradient_checkpointing}",
            f"data.train_files={data_file}",
            f"data.train_batch_size={workload.prompts}",
            f"data.max_prompt_length={workload.prompt_length}",
            f"data.max_response_length={workload.response_length}",
            "data.shuffle=False",
            "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=False",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={workload.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={workload.micro_batch}",
            f"actor_rollout_ref.rollout.n={workload.n}",
            "actor_rollout_ref.rollout.ignore_eos=True",
            f"actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}",
            f"custom_reward_function.path={reward_file}",
            "custom_reward_function.name=compute_score",
            f"trainer.total_training_steps={workload.total_steps}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.val_before_train=False"]


def run_ember(workload: Workload, overrides: list[str], profile_dir: str | None = None,
              use_ray: bool = False) -> FrameworkResult:
    """`workload.total_steps` calls of `RLTrainer.train_step`, as `ember train` makes them; `use_ray`:
    the roles in a Ray worker process even at one GPU (the multi-GPU path; several GPUs,
    `trainer.n_gpus_per_node`, always take it); the last step profiled into `profile_dir` if given."""
    steps = workload.total_steps
    if profile_dir is not None:  # one more step, profiled and not timed
        steps += 1
        overrides = overrides + [f"trainer.total_training_steps={steps}", "global_profiler.tool=torch",
                                 f"global_profiler.steps=[{steps}]",
                                 f"global_profiler.save_path={os.path.join(profile_dir, 'ray' if use_ray else 'in-process')}"]
    cfg = load_config(overrides)
    check_implemented(cfg)
    reset_peak_memory()
    memory_before = allocated_memory_gib()
    trainer = RLTrainer(cfg, build_components(cfg, use_ray=use_ray or None))
    try:
        step_s, step_metrics = time_ember_steps(trainer, steps)
    finally:
        trainer.parts.reward_manager.close()
        trainer.parts.shutdown()
        trainer.logger.close()
    peak_memory = peak_memory_gib()
    del trainer
    release_ember()
    timed = step_metrics[workload.warmup:workload.total_steps]
    phases = sorted({key for metrics in timed for key in metrics if key.startswith("timing_s/")})
    return FrameworkResult(
        framework="ember (Ray worker)" if use_ray else "ember", step_s=step_s[workload.warmup:workload.total_steps],
        phases_s={key.removeprefix("timing_s/"): [metrics.get(key, 0.0) for metrics in timed] for key in phases},
        tokens_per_step=timed[-1]["perf/total_num_tokens"], peak_memory_gib=peak_memory,
        notes={"response_length_mean": timed[-1]["response_length/mean"], "memory_before_gib": memory_before,
               "rollout_max_num_seqs": cfg.actor_rollout_ref.rollout.max_num_seqs,
               "compute_dtype": compute_dtype(cfg.actor_rollout_ref.model.dtype),
               "master_dtype": cfg.actor_rollout_ref.actor.fsdp_config.model_dtype})


def time_ember_steps(trainer: RLTrainer, steps: int) -> tuple[list[float], list[dict[str, float]]]:
    """Wall time (device synchronised) and metrics of each of `steps` steps."""
    step_s, step_metrics = [], []
    while trainer.step < steps:
        prompts = trainer.next_prompts()
        trainer.step += 1
        start = time.perf_counter()
        metrics = trainer.train_step(prompts)
        synchronize()
        step_s.append(time.perf_counter() - start)
        step_metrics.append(metrics)
        print(f"ember step {trainer.step}/{steps}: {step_s[-1]:.2f} s", flush=True)
    return step_s, step_metrics


# --- TRL -------------------------------------------------------------------------------------------


def run_trl(workload: Workload, model_dir: str, prompts: list[list[dict]], reward_file: str, out_dir: str,
            seed: int) -> FrameworkResult:
    """`GRPOTrainer.train()` for `workload.total_steps` optimizer steps, timed by a callback."""
    import datasets
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = resolve_reward_fn(reward_file).load()

    def benchmark_reward(completions, **kwargs) -> list[float]:
        # Conversational prompts give conversational completions: [{"role": "assistant", "content": ...}].
        return [reward(RewardItem(DATA_SOURCE, completion[-1]["content"], "0", {})) for completion in completions]

    on_accelerator = accelerator_available()
    # TRL counts per_device_train_batch_size in completions. One optimizer step accumulates
    # gradients over samples / micro_batch micro-batches; with steps_per_generation equal to
    # that count, one generate call makes the whole batch (generation_batch_size = samples)
    # and one optimizer step consumes it. Generation and update stay aligned, so TRL skips
    # the old log-prob pass, as ember does with one update per batch.
    accumulation = workload.samples // workload.micro_batch
    config = GRPOConfig(
        output_dir=out_dir, max_steps=workload.total_steps, seed=seed,
        per_device_train_batch_size=workload.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=workload.n,
        max_completion_length=workload.response_length,
        # EOS can never be sampled: every completion is exactly max_completion_length tokens.
        generation_kwargs={"min_new_tokens": workload.response_length},
        gradient_checkpointing=workload.gradient_checkpointing, bf16=on_accelerator, use_cpu=not on_accelerator,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},  # fp32 master weights, as ember
        learning_rate=1e-6, beta=0.0, shuffle_dataset=False,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    reset_peak_memory()
    memory_before = allocated_memory_gib()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=benchmark_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.remove_callback(PrinterCallback)
    phase_totals = {"gen": 0.0, "generate_and_score": 0.0}
    trainer._generate = _timed(trainer._generate, phase_totals, "gen")
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, phase_totals,
                                                     "generate_and_score")

    class StepTimer(TrainerCallback):
        """Wall clock from the first micro-batch to the optimizer step, and the generation inside it."""

        def __init__(self):
            self.step_s: list[float] = []
            self.phases_s: dict[str, list[float]] = {"gen": [], "score": [], "train": []}
            self.response_length_mean = 0.0  # TRL's completions/mean_length of the last logged step
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            phase_totals.update(gen=0.0, generate_and_score=0.0)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            step = time.perf_counter() - self.start
            self.step_s.append(step)
            self.phases_s["gen"].append(phase_totals["gen"])
            self.phases_s["score"].append(phase_totals["generate_and_score"] - phase_totals["gen"])
            self.phases_s["train"].append(step - phase_totals["generate_and_score"])
            print(f"trl step {state.global_step}/{workload.total_steps}: {step:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.response_length_mean = logs["completions/mean_length"]

    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    response_length = timer.response_length_mean
    return FrameworkResult(
        framework="trl", step_s=timer.step_s[workload.warmup:],
        phases_s={name: values[workload.warmup:] for name, values in timer.phases_s.items()},
        tokens_per_step=workload.samples * (workload.prompt_length + response_length),
        peak_memory_gib=peak_memory_gib(),
        notes={"response_length_mean": response_length, "memory_before_gib": memory_before,
               "per_device_train_batch_size": workload.micro_batch,
               "gradient_accumulation_steps": accumulation, "generation_batch_size": config.generation_batch_size,
               "loss_type": config.loss_type, "optim": config.optim.value, "bf16": config.bf16})


def _timed(method, totals: dict[str, float], name: str):
    """`method`, adding its device-synchronised wall time to `totals[name]` on every call."""
    def wrapper(*args, **kwargs):
        synchronize()
        start = time.perf_counter()
        output = method(*args, **kwargs)
        synchronize()
        totals[name] += time.perf_counter() - start
        return output
    return wrapper


# --- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(prompts=args.prompts, n=args.n, prompt_length=args.prompt_length,
                        response_length=args.response_length,
                        micro_batch=min(args.micro_batch, args.prompts * args.n), warmup=args.warmup, steps=args.steps,
                        gradient_checkpointing=args.gradient_checkpointing)
    workload.check()
    if not args.skip_trl and package_version("trl") == "not installed":
        raise SystemExit("TRL is not installed: `pip install trl datasets` to compare with it, or pass --skip-trl")
    env = environment(args.commit or git_commit(REPO_DIR))
    summaries = []
    with tempfile.TemporaryDirectory(prefix="ember-grpo-bench-") as work_dir:
        tokenizer = train_tiny_tokenizer()
        dtype = torch.bfloat16 if accelerator_available() else torch.float32
        model_dir = build_model_dir(args.shape, tokenizer, os.path.join(work_dir, "model"), dtype, args.seed)
        prompts = make_prompts(tokenizer, workload.prompts * workload.total_steps, workload.prompt_length, args.seed)
        data_file = write_prompt_parquet(prompts, os.path.join(work_dir, "prompts.parquet"))
        reward_file = write_reward_file(work_dir)
        if not args.skip_ember:
            run_dir = os.path.join(work_dir, "ember-run")
            overrides = ember_overrides(workload, model_dir, data_file, reward_file, run_dir, args.ember_max_num_seqs)
            overrides += FAST_TRAINING if args.fast_training else []
            ray_overrides = overrides + args.ember_override + [f"trainer.default_local_dir={run_dir}-ray"]
            if args.ray and args.ray_first:
                summaries.append(run_ember(workload, ray_overrides, args.profile, use_ray=True).summary())
            summaries.append(run_ember(workload, overrides + args.ember_override, args.profile).summary())
            if args.ray and not args.ray_first:
                summaries.append(run_ember(workload, ray_overrides, args.profile, use_ray=True).summary())
        if not args.skip_trl:
            summaries.append(run_trl(workload, model_dir, prompts, reward_file, os.path.join(work_dir, "trl-run"),
                                     args.seed).summary())
    print()
    print(format_report("GRPO step: ember vs TRL", env, workload, args.shape, summaries, MAIN_PHASES))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report_json(env, workload, args.shape, summaries), handle, indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
