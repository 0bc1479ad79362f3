"""Whole GRPO/PPO steps at each parallel layout against the one-GPU run: `ember train` in a fresh process per
layout, the same random model, prompts, reward and seed, generation by ember's engine (batch-invariant
sampling: every layout draws the same responses from the same weights), two steps each.

Prints one table per workload: the first steps' `actor/grad_norm`, `actor/pg_loss`, `actor/entropy` (step 2:
after an update) and `critic/score/mean`, the critic's grad norm for PPO, the step time of step 2 and the peak
memory of the slowest rank. Rows of one workload must agree within bf16 rounding; a layout that trains on other
samples (the bug this guards against) moves the grad norm by tens of percent.

    python benchmarks/layout_parity.py --out parity.json            # every workload and layout (4 GPUs)
    python benchmarks/layout_parity.py --workload grpo --max-gpus 2

The `nla` workload is `ember nla train` on the NLA fork's 7B run file (tests/nla_configs) with the
model and data swapped for a random Qwen2.5-0.5B shape whose tokenizer has the injection marker and
vectors of its hidden size: actor and critic on Megatron at TP=1 (one GPU), TP=2 on split pools
(2 + 2), TP=2 × DP=2 shared, and FSDP2 over four GPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoConfig

from ember.data.parquet import write_parquet
from ember.models.tiny import train_tiny_tokenizer
from ember.nla.marker import MARKER_CANDIDATES
from ember.trainer.loggers import read_jsonl_metrics

from common import REPO_DIR, Workload, build_model_dir, environment, format_number, git_commit, make_prompts, \
    markdown_table, write_prompt_parquet, write_results, write_reward_file
from grpo_step import ember_overrides

MEGATRON = "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron"


def megatron(role: str, tp: int = 1, pp: int = 1, ep: int = 1) -> list[str]:
    section = "critic" if role == "critic" else f"actor_rollout_ref.{role}"
    return [f"{section}.strategy=megatron", f"{section}.megatron.tensor_model_parallel_size={tp}",
            f"{section}.megatron.pipeline_model_parallel_size={pp}", f"{section}.megatron.expert_model_parallel_size={ep}"]


def actor(tp: int = 1, pp: int = 1, ep: int = 1) -> list[str]:
    return megatron("actor", tp, pp, ep) + megatron("ref", tp, pp, ep)


def nla_megatron(tp: int = 1) -> list[str]:
    return megatron("actor", tp) + megatron("ref", tp) + megatron("critic", tp)


NLA_SPLIT = ["+ray_kwargs.resource_pool.actor_rollout.num_gpus=2", "+ray_kwargs.resource_pool.critic.num_gpus=2"]
PPO = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-5", "critic.ppo_micro_batch_size_per_gpu=8"]
AQN = ["trainer.noise_injection.enabled=True"]
# workload -> (model shape, [(row name, GPUs, overrides)])
WORKLOADS = {
    "grpo": ("qwen2.5-0.5b", [
        ("fsdp2", 1, []), ("megatron TP=1", 1, actor()), ("megatron TP=2", 2, actor(tp=2)),
        ("megatron PP=2", 2, actor(pp=2)), ("fsdp2 DP=2", 2, []), ("megatron TP=2 PP=2", 4, actor(tp=2, pp=2)),
        ("megatron TP=2 DP=2", 4, actor(tp=2))]),
    "ppo": ("qwen2.5-0.5b", [
        ("megatron actor + critic TP=1", 1, actor() + megatron("critic") + PPO),
        ("megatron actor + critic TP=2", 2, actor(tp=2) + megatron("critic", tp=2) + PPO)]),
    "qwen3": ("qwen3-0.6b", [
        ("megatron TP=1", 1, actor()), ("megatron TP=2 PP=2", 4, actor(tp=2, pp=2))]),
    "moe-aqn": ("qwen1.5-moe-a2.7b-2l", [
        ("megatron EP=1, AQN", 1, actor() + AQN), ("megatron EP=2, AQN", 2, actor(ep=2) + AQN)]),
    "nla": ("qwen2.5-0.5b", [
        ("fsdp2, shared", 1, []), ("megatron TP=1, shared", 1, nla_megatron()),
        ("megatron TP=1 x DP=2, shared", 2, nla_megatron()),
        ("megatron TP=2, split 2 + 2", 4, nla_megatron(tp=2) + NLA_SPLIT),
        ("megatron TP=2 x DP=2, shared", 4, nla_megatron(tp=2)), ("fsdp2 DP=4, shared", 4, [])]),
}
KEYS = ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "critic/score/mean", "critic/grad_norm",
        "critic/critic_loss")
NLA_CONFIGS = os.path.join(REPO_DIR, "tests", "nla_configs")
NLA_MARKER = MARKER_CANDIDATES[0]  # the marker the engine picks first


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="default: all")
    parser.add_argument("--max-gpus", type=int, default=torch.cuda.device_count() or 1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--shape", default=None, help="one model shape for every workload (e.g. tiny, a CPU smoke run)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the layouts whose name is this (repeatable)")
    parser.add_argument("--override", action="append", default=[], help="an override added to every run")
    parser.add_argument("--out", default=None, help="results as JSON (rewritten after every run)")
    return parser.parse_args(argv)


def run_layout(command: list[str], gpus: int, overrides: list[str], run_dir: str, timeout: float) -> dict:
    command = [sys.executable, "-m", "ember", *command, f"trainer.n_gpus_per_node={gpus}",
               f"trainer.rollout_data_dir={os.path.join(run_dir, 'dumps')}",
               f"trainer.default_local_dir={run_dir}", "trainer.logger=['console']", *overrides]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)
    if result.returncode:
        return {"error": (result.stdout + result.stderr)[-1500:], "wall_s": time.perf_counter() - start}
    steps = {}
    for record in read_jsonl_metrics(os.path.join(run_dir, "metrics.jsonl")):
        steps.setdefault(int(record["step"]), {}).update(record)
    if 2 not in steps:
        return {"error": "no step 2 in metrics.jsonl\n" + result.stdout[-1500:], "wall_s": time.perf_counter() - start}
    digests = {step: responses_digest(os.path.join(run_dir, "dumps", f"{step}.jsonl")) for step in (1, 2)}
    memory = max((value for key, value in steps[2].items() if key.endswith("peak_memory_gb")), default=None)
    return {"steps": {step: {key: steps[step].get(key) for key in KEYS} | {"responses": digests[step]}
                      for step in (1, 2)},
            "step_s": steps[2].get("timing_s/step"), "peak_memory_gb": memory, "wall_s": time.perf_counter() - start}


def responses_digest(path: str) -> str | None:
    """The first 8 hex digits of a hash of one step's sampled responses (the rollout dump), in order: equal
    digests mean two layouts trained on the same samples."""
    if not os.path.exists(path):
        return None
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    return hashlib.sha256(json.dumps([record["output"] for record in records]).encode()).hexdigest()[:8]


def nla_command(workload: Workload, model_dir: str, data_file: str, layer: int, run_dir: str) -> list[str]:
    """`ember nla train` of the fork's 7B file on `model_dir` and `data_file`, two steps, no evaluation."""
    return ["nla", "train", "--config-path", NLA_CONFIGS, "--config-name", "runs/qwen_7b/rl_grpo",
            f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
            f"critic.output_layer_index={layer}", f"data.train_files=[{data_file}]", "data.val_files=null",
            "nla_eval.enabled=false", f"data.train_batch_size={workload.prompts}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={workload.prompts * workload.n}",
            f"critic.ppo_mini_batch_size={workload.prompts * workload.n}", f"actor_rollout_ref.rollout.n={workload.n}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={workload.micro_batch}",
            f"critic.ppo_micro_batch_size_per_gpu={workload.micro_batch}", "trainer.total_training_steps=2",
            f"data.max_response_length={workload.response_length}", f"data.max_prompt_length={workload.prompt_length}",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "critic.optim.lr_warmup_steps=0",
            "critic.optim.lr=1e-5", "trainer.save_freq=-1",
            "actor_rollout_ref.rollout.name=ember", "actor_rollout_ref.rollout.ignore_eos=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=false",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
            "critic.model.fsdp_config.param_offload=false", "critic.model.fsdp_config.optimizer_offload=false",
            "trainer.val_before_train=False"]


def write_nla_data(hidden_size: int, layer: int, count: int, path: str) -> str:
    """`count` rows of an NLA RL parquet in the fork's form: the marker prompt and a random vector each, read
    at hidden_states[`layer`]."""
    generator = torch.Generator().manual_seed(0)
    rows = [{"prompt": [{"role": "user", "content": f"Explain the following: <concept>{NLA_MARKER}</concept>\n"}],
             "activation_vector": torch.randn(hidden_size, generator=generator).tolist(), "sample_uuid": f"u{index}",
             "activation_layer": layer, "activation_token_id": 7, "source_sequence_token_index": 3,
             "immediate_prefix": "The quick"} for index in range(count)]
    return write_parquet(rows, path)


def table(rows: list[tuple[str, int, dict]]) -> str:
    def number(value, digits=6):
        return format_number(value, digits)
    lines = []
    for name, gpus, result in rows:
        if "error" in result:
            lines.append([name, str(gpus), "failed: " + result["error"].splitlines()[-1][:80]] + [""] * 9)
            continue
        one, two = result["steps"][1], result["steps"][2]
        lines.append([name, str(gpus), number(one["actor/grad_norm"]), number(two["actor/grad_norm"]),
                      number(one["actor/pg_loss"]), number(two["actor/entropy"], 5), number(one["critic/score/mean"], 4),
                      number(one["critic/grad_norm"]), one.get("responses") or "-", two.get("responses") or "-",
                      number(result["step_s"], 2), number(result["peak_memory_gb"], 1)])
    return markdown_table(["layout", "GPUs", "grad_norm 1", "grad_norm 2", "pg_loss 1", "entropy 2", "score 1",
                           "critic grad_norm 1", "responses 1", "responses 2", "step 2 s", "peak GiB"], lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment(git_commit(REPO_DIR))
    results = {"environment": env, "workloads": {}}
    workload = Workload(prompts=args.prompts, n=args.n, prompt_length=64, response_length=args.response_length,
                        micro_batch=8, warmup=0, steps=2, gradient_checkpointing=False)
    with tempfile.TemporaryDirectory(prefix="ember-parity-") as work_dir:
        tokenizer = train_tiny_tokenizer(texts=[NLA_MARKER] * 200)  # the marker one token, for the NLA workload
        prompts = make_prompts(tokenizer, workload.prompts * 2, workload.prompt_length, seed=0)
        data_file = write_prompt_parquet(prompts, os.path.join(work_dir, "prompts.parquet"))
        reward_file = write_reward_file(work_dir)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        for name in args.workload or list(WORKLOADS):
            shape, layouts = WORKLOADS[name]
            shape = args.shape or shape
            model_dir = build_model_dir(shape, tokenizer, os.path.join(work_dir, shape), dtype, seed=0)
            if name == "nla":
                config = AutoConfig.from_pretrained(model_dir)
                layer = config.num_hidden_layers // 2  # the critic reads the middle layer's output
                nla_file = write_nla_data(config.hidden_size, layer, workload.prompts * 2,
                                          os.path.join(work_dir, f"rl_train_layer{layer}.parquet"))
            rows = []
            for row, gpus, overrides in layouts:
                if gpus > args.max_gpus or (args.only and row not in args.only):
                    continue
                run_dir = os.path.join(work_dir, f"{name}-{len(rows)}")
                if name == "nla":
                    command = nla_command(workload, model_dir, nla_file, layer, run_dir)
                else:
                    command = ["train", *ember_overrides(workload, model_dir, data_file, reward_file, run_dir,
                                                         max_num_seqs=1024)]
                rows.append((row, gpus, run_layout(command, gpus, overrides + args.override, run_dir, args.timeout)))
                print(f"{name} / {row}: {json.dumps(rows[-1][2])[:300]}", flush=True)
                results["workloads"][name] = {"shape": shape, "rows": rows}
                write_results(args.out, results)
            print(f"\n### {name} ({shape}, {workload.prompts} prompts x {workload.n} x {workload.response_length} "
                  f"tokens; {env['device']}, {env['commit']}, {env['date']})\n\n{table(rows)}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
