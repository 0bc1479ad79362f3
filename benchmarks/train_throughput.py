"""Training throughput of ember's FSDP engine: the padded baseline against the speed switches
(dynamic batch size, padding-free packing, fused log-probs), in one run and one report.

Every setting trains the same randomly initialised model (`--shape`) with ember's actor
(`Actor.update`: the PPO-clip loss, token-mean, entropy as a metric) on the same batches,
one optimizer step per batch of `--sequences` sequences, fp32 master weights with bf16
compute on an accelerator (fp32 on CPU), on two workloads:

- `fixed`: every sequence is `--prompt-length` prompt + `--response-length` response tokens;
- `mixed`: responses uniform in [`--min-response`, `--max-response`] tokens.

The settings, each a fresh `FSDPEngine` with gradient checkpointing unless it says otherwise:
`padded baseline` (micro-batches of `--micro-batch` sequences, `--mixed-micro-batch` on the
mixed workload, each padded to the batch's width),
`dynamic bsz` (micro-batches by a token budget, `--max-token-len`, trimmed to their own
width), `packing` (`use_remove_padding`), `packing + dynamic bsz`, `packing + dynamic bsz +
fused` (`use_fused_kernels`), and rows on top of the last: without gradient checkpointing,
with parameter and optimizer offload (`engine.offload()` after each step, `onload()` before
it, both inside the timed step), with FSDP2's CPU offload policy (`offload_policy`), and
with compiled decoder layers (`use_torch_compile`), with and without gradient checkpointing.
The last three need an accelerator and are left out on CPU, as are the Megatron rows
(`strategy=megatron` at TP = PP = 1: megatron-core's DDP and distributed optimizer, bf16
parameters with fp32 master weights in the optimizer, padded micro-batches or a token budget,
full recompute as its gradient checkpointing; the last two rows pack each token-budget
micro-batch into one row, `use_remove_padding`, megatron-core's THD format).

Columns: tokens/s counts real (non-pad) prompt and response tokens over the timed steps;
`padding` is the share of the positions the model runs over that are padding; peak memory
is the allocator's peak over the setting's steps (reset per setting), and `between steps`
what stays allocated after a step (after `offload()` where the setting offloads); `fp32
logits` is the size of the float32 [rows, vocab] logits of the setting's largest
micro-batch: what the unfused path holds (several times over in backward) and the fused
kernel never builds; the last step's loss is the same in every row (the switches change how,
not what). A setting that runs out of memory is reported as OOM.

    python benchmarks/train_throughput.py --out train_throughput.json   # GPU: Qwen2.5-0.5B shape
    python benchmarks/train_throughput.py --tiny                         # CPU smoke run, seconds
    python benchmarks/train_throughput.py --shape qwen1.5-moe-a2.7b-4l --settings 5,14  # grouped experts vs a loop
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch

from ember.algorithms import ClipConfig
from ember.data.batch import Batch
from ember.distributed.device import synchronize
from ember.engines.base import MicroBatchSpec
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.micro_batches import min_micro_batch_count, plan_micro_batches, used_extents
from ember.engines.optim import OptimOptions
from ember.models.tiny import train_tiny_tokenizer
from ember.trainer.rank_setup import compute_dtype
from ember.workers.actor import Actor, ActorOptions

from common import (  # benchmarks/common.py: a script's own folder is on sys.path
    REPO_DIR,
    SHAPES,
    accelerator_available,
    allocated_memory_gib,
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

MASTER_DTYPE = "float32"  # the engine's stored and updated weights, as `ember train` keeps them
GIB = 2**30


@dataclass(frozen=True)
class TrainWorkload:
    """One batch's shape: `sequences` samples of `prompt_length` prompt tokens and responses
    of `min_response`..`max_response` tokens (uniform), one optimizer step per batch."""

    name: str
    sequences: int
    prompt_length: int
    min_response: int
    max_response: int
    micro_batch: int  # sequences per micro-batch without dynamic bsz (the padded baseline's)

    def describe(self) -> str:
        responses = (f"{self.max_response}" if self.min_response == self.max_response
                     else f"uniform {self.min_response}–{self.max_response}")
        return (f"{self.sequences} sequences × ({self.prompt_length} prompt + {responses} response tokens), "
                f"micro-batch {self.micro_batch} sequences without dynamic bsz")

    def check(self) -> None:
        lengths_ok = 1 <= self.min_response <= self.max_response
        if min(self.sequences, self.prompt_length, self.micro_batch) < 1 or not lengths_ok:
            raise SystemExit(f"{self.name} workload: --sequences, --prompt-length and the micro-batch must be >= 1, "
                             "and 1 <= --min-response <= --max-response")


@dataclass(frozen=True)
class RunOptions:
    """What every setting shares."""

    max_token_len: int  # token budget per micro-batch with dynamic bsz
    warmup: int  # untimed steps first, per setting and workload
    steps: int  # timed steps
    compute_dtype: str  # dtype of forward and backward
    master_dtype: str  # dtype of the stored weights and the optimizer update
    attn_implementation: str
    seed: int

    def check(self) -> None:
        if min(self.max_token_len, self.steps) < 1 or self.warmup < 0:
            raise SystemExit("--max-token-len and --steps must be >= 1 and --warmup >= 0")


@dataclass(frozen=True)
class BenchmarkSpec:
    """What ran, as the JSON report records it."""

    options: RunOptions
    workloads: tuple[TrainWorkload, ...]


@dataclass(frozen=True)
class Setting:
    """One row: which engine switches are on."""

    name: str
    remove_padding: bool = False
    dynamic_bsz: bool = False
    fused: bool = False
    gradient_checkpointing: bool = True
    offload: bool = False
    offload_policy: bool = False
    compile_layers: bool = False
    megatron: bool = False  # the Megatron engine (TP = PP = 1, distributed optimizer) instead of FSDP2
    expert_loop: bool = False  # a MoE shape's experts as transformers' loop over experts, not grouped matmuls

    @property
    def needs_accelerator(self) -> bool:
        return self.offload_policy or self.compile_layers or self.megatron

    def micro_batch_spec(self, workload: TrainWorkload, options: RunOptions) -> MicroBatchSpec:
        return (MicroBatchSpec(max_token_len=options.max_token_len) if self.dynamic_bsz
                else MicroBatchSpec(size=workload.micro_batch))


ALL_ON = Setting("packing + dynamic bsz + fused", remove_padding=True, dynamic_bsz=True, fused=True)
SETTINGS = (
    Setting("padded baseline"),
    Setting("dynamic bsz", dynamic_bsz=True),
    Setting("packing", remove_padding=True),
    Setting("packing + dynamic bsz", remove_padding=True, dynamic_bsz=True),
    ALL_ON,
    replace(ALL_ON, name=ALL_ON.name + ", no gradient checkpointing", gradient_checkpointing=False),
    replace(ALL_ON, name=ALL_ON.name + ", param + optimizer offload", offload=True),
    replace(ALL_ON, name=ALL_ON.name + ", FSDP2 CPU offload policy", offload_policy=True),
    replace(ALL_ON, name=ALL_ON.name + ", compiled layers", compile_layers=True),
    replace(ALL_ON, name=ALL_ON.name + ", compiled layers, no gradient checkpointing", compile_layers=True,
            gradient_checkpointing=False),  # the GRPO benchmark's fastest update
    Setting("megatron TP=1, padded", megatron=True),
    Setting("megatron TP=1, dynamic bsz", megatron=True, dynamic_bsz=True),
    Setting("megatron TP=1, dynamic bsz, no recompute", megatron=True, dynamic_bsz=True, gradient_checkpointing=False),
    replace(ALL_ON, name=ALL_ON.name + ", MoE experts as a per-expert loop", expert_loop=True),
    Setting("megatron TP=1, packing + dynamic bsz", megatron=True, remove_padding=True, dynamic_bsz=True),
    Setting("megatron TP=1, packing + dynamic bsz, no recompute", megatron=True, remove_padding=True,
            dynamic_bsz=True, gradient_checkpointing=False),
)
BASELINE, UNFUSED = SETTINGS[0].name, SETTINGS[3].name  # the rows the speed-up and the fused saving compare with


# --- inputs and micro-batch shapes (pure) ----------------------------------------------------------


def make_batches(workload: TrainWorkload, count: int, vocab_size: int, pad_token_id: int, seed: int) -> list[Batch]:
    """`count` batches of random token ids (no EOS: every response has its drawn length), with
    one random advantage per sequence (as GRPO gives), the same for every setting."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        prompts = [[rng.randrange(vocab_size) for _ in range(workload.prompt_length)]
                   for _ in range(workload.sequences)]
        responses = [[rng.randrange(vocab_size) for _ in range(rng.randint(workload.min_response,
                                                                           workload.max_response))]
                     for _ in range(workload.sequences)]
        batch = Batch.from_rollout(prompts, responses, pad_token_id=pad_token_id)
        advantages = torch.randn(workload.sequences, 1, generator=generator) * batch.response_mask
        batches.append(replace(batch, advantages=advantages))
    return batches


@dataclass(frozen=True)
class MicroBatchShape:
    """What one micro-batch costs: the positions the model runs over, and the LM head's rows."""

    positions: int  # token positions through the decoder, padding included
    logit_rows: int  # rows of the [rows, vocab] logits the unfused path builds


def micro_batch_shapes(batch: Batch, setting: Setting, workload: TrainWorkload,
                       options: RunOptions) -> list[MicroBatchShape]:
    """The micro-batches the engine runs `batch` in under `setting` (one rank), with the planning
    functions the engine itself calls: fixed-size micro-batches keep the batch's width; token-
    budget ones are trimmed to the columns their samples use; packed ones hold real tokens only."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    prompt_starts, response_lengths = used_extents(batch)
    if setting.dynamic_bsz:
        groups = plan_micro_batches(lengths, options.max_token_len,
                                    min_micro_batch_count(lengths, options.max_token_len))
    else:
        indices = list(range(len(batch)))
        groups = [indices[start:start + workload.micro_batch] for start in range(0, len(batch), workload.micro_batch)]
    shapes = []
    for group in groups:
        if setting.remove_padding:
            shapes.append(MicroBatchShape(sum(lengths[i] for i in group), sum(response_lengths[i] for i in group)))
            continue
        prompt_width = batch.prompt_length - (min(prompt_starts[i] for i in group) if setting.dynamic_bsz else 0)
        response_width = max(response_lengths[i] for i in group) if setting.dynamic_bsz else batch.response_length
        shapes.append(MicroBatchShape(len(group) * (prompt_width + response_width), len(group) * response_width))
    return shapes


# --- one setting on one workload -------------------------------------------------------------------


def build_actor(model_dir: str, setting: Setting, workload: TrainWorkload, options: RunOptions,
                batch: Batch) -> Actor:
    """ember's actor on a fresh engine with `setting`'s switches: one PPO-clip update per batch."""
    engine = megatron_engine(model_dir, setting, options) if setting.megatron else FSDPEngine(EngineOptions(
        model_path=model_dir, role="actor", model_dtype=options.master_dtype, param_dtype=options.compute_dtype,
        attn_implementation=options.attn_implementation, enable_gradient_checkpointing=setting.gradient_checkpointing,
        use_remove_padding=setting.remove_padding, use_fused_kernels=setting.fused,
        param_offload=setting.offload, optimizer_offload=setting.offload, offload_policy=setting.offload_policy,
        compile_layers=setting.compile_layers, seed=options.seed, optim=OptimOptions(),
        override_config={"_experts_implementation": "eager"} if setting.expert_loop else {}))
    spec = setting.micro_batch_spec(workload, options)
    return Actor(engine, ActorOptions(
        mini_batch_samples=len(batch), micro_batch=spec, log_prob_micro_batch=spec, ppo_epochs=1, shuffle=False,
        policy_loss="vanilla", clip=ClipConfig(), loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="low_var_kl", temperature=1.0, norm_length=batch.response_length,
        seed=options.seed))


def megatron_engine(model_dir: str, setting: Setting, options: RunOptions):
    """The Megatron engine at TP = PP = 1 with the distributed optimizer, packed where the setting packs;
    gradient checkpointing as megatron-core's full recompute of every layer."""
    from ember.engines.megatron.engine import MegatronEngine
    from ember.engines.megatron.options import MegatronOptions

    recompute = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                 if setting.gradient_checkpointing else {})
    return MegatronEngine(MegatronOptions(model_path=model_dir, role="actor", param_dtype=options.compute_dtype,
                                          seed=options.seed, override_transformer_config=recompute,
                                          use_remove_padding=setting.remove_padding, optim=OptimOptions()))


def run_setting(setting: Setting, workload: TrainWorkload, model_dir: str, batches: list[Batch], vocab_size: int,
                options: RunOptions) -> dict[str, object]:
    """All batches through `setting`, the first `options.warmup` untimed; the row's summary."""
    timed = batches[options.warmup:]
    shapes = [shape for batch in timed for shape in micro_batch_shapes(batch, setting, workload, options)]
    tokens = sum(int(batch.attention_mask.sum()) for batch in timed)
    summary = {"workload": workload.name, "setting": setting.name, "switches": asdict(setting),
               "micro_batches_per_step": len(shapes) / len(timed),
               "padding_fraction": 1 - tokens / sum(shape.positions for shape in shapes),
               "largest_fp32_logits_gib": max(shape.logit_rows for shape in shapes) * vocab_size * 4 / GIB}
    try:
        summary.update(time_setting(setting, workload, model_dir, batches, options))
        summary["tokens_per_s"] = tokens / sum(summary["step_s_all"])
    except torch.OutOfMemoryError:
        summary["error"] = "OOM"
    release_ember()  # outside the except block: its traceback no longer holds the step's tensors
    status = summary.get("error") or f"{format_number(summary['tokens_per_s'], 0)} tokens/s"
    print(f"{workload.name} / {setting.name}: {status}", flush=True)
    return summary


def time_setting(setting: Setting, workload: TrainWorkload, model_dir: str, batches: list[Batch],
                 options: RunOptions) -> dict[str, object]:
    """Step times, losses and memory of `setting` over `batches` (the engine is freed on return)."""
    actor = build_actor(model_dir, setting, workload, options, batches[0])
    reset_peak_memory()
    step_s, losses = [], []
    for step, batch in enumerate(batches):
        synchronize()
        start = time.perf_counter()
        if setting.offload:
            actor.engine.onload()
        metrics = actor.update(batch, step)
        if setting.offload:
            actor.engine.offload()
        synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(metrics["actor/loss"])
        print(f"  {setting.name} step {step + 1}/{len(batches)}: {step_s[-1]:.2f} s, loss {losses[-1]:.4f}",
              flush=True)
    return {"step_s": statistics.median(step_s[options.warmup:]), "step_s_all": step_s[options.warmup:],
            "loss_all": losses[options.warmup:], "peak_memory_gib": peak_memory_gib(),
            "between_steps_gib": allocated_memory_gib()}


# --- the report ------------------------------------------------------------------------------------


def format_train_report(env: dict[str, str], workloads: list[TrainWorkload], options: RunOptions, model: str,
                        summaries: list[dict]) -> str:
    """The environment, and per workload one row per setting and the fused kernel's saving, as Markdown."""
    lines = ["## Training throughput: ember's FSDP engine, padded vs dynamic bsz, packing and fused log-probs", "",
             f"{env['date']} · commit {env['commit']} · {env['device']} · torch {env['torch']} · "
             f"transformers {env['transformers']} · Python {env['python']}", "",
             f"model {model} · ember's actor (PPO clip, token-mean), one optimizer step per batch · "
             f"micro-batches of {options.max_token_len} tokens with dynamic bsz · "
             f"{options.compute_dtype} compute, {options.master_dtype} master weights · "
             f"attention {options.attn_implementation} · median of {options.steps} steps after "
             f"{options.warmup} warm-up"]
    for workload in workloads:
        rows_of = {summary["setting"]: summary for summary in summaries if summary["workload"] == workload.name}
        baseline = rows_of.get(BASELINE, {}).get("tokens_per_s")
        rows = []
        for summary in rows_of.values():
            speed = summary.get("tokens_per_s")
            speedup = format_number(speed / baseline, 2) + "×" if speed and baseline else "-"
            failed = summary.get("error")
            rows.append([summary["setting"], format_number(summary["micro_batches_per_step"], 1),
                         format_number(100 * summary["padding_fraction"], 1),
                         failed or format_number(summary["step_s"], 2), failed or format_number(speed, 0), speedup,
                         failed or format_number(summary["peak_memory_gib"], 1),
                         failed or format_number(summary["between_steps_gib"], 1),
                         format_number(summary["largest_fp32_logits_gib"], 3),
                         failed or format_number(summary["loss_all"][-1], 4)])
        lines += ["", f"### {workload.name}: {workload.describe()}", "",
                  markdown_table(["setting", "micro-batches", "padding (%)", "step (s, median)", "tokens/s",
                                  "vs padded", "peak memory (GiB)", "between steps (GiB)", "fp32 logits (GiB)",
                                  "loss (last step)"], rows)]
        lines += ["", fused_saving_line(rows_of.get(UNFUSED, {}), rows_of.get(ALL_ON.name, {}))]
    return "\n".join(lines)


def fused_saving_line(unfused: dict, fused: dict) -> str:
    """The fused kernel's peak-memory saving against the fp32 logits it avoids (same micro-batches)."""
    if unfused.get("peak_memory_gib") is None or fused.get("peak_memory_gib") is None:
        return "Fused kernel saving: not measured (needs an accelerator, and both rows to run)."
    saving = unfused["peak_memory_gib"] - fused["peak_memory_gib"]
    logits = fused["largest_fp32_logits_gib"]
    return (f"Fused kernel saving: peak memory {format_number(unfused['peak_memory_gib'], 1)} → "
            f"{format_number(fused['peak_memory_gib'], 1)} GiB ({UNFUSED} → {ALL_ON.name}), "
            f"{format_number(saving, 2)} GiB saved against {format_number(logits, 2)} GiB of fp32 logits of the "
            f"largest micro-batch ({format_number(saving / logits, 2)}× their size).")


# --- the run ---------------------------------------------------------------------------------------


TINY_DEFAULTS = dict(shape="tiny", sequences=16, prompt_length=16, response_length=32, min_response=4,
                     max_response=64, micro_batch=4, mixed_micro_batch=4, max_token_len=256, warmup=1, steps=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help=f"CPU smoke run: a tiny model and few short sequences ({TINY_DEFAULTS}); "
                             "flags given explicitly still win")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model architecture (random weights); default qwen2.5-0.5b")
    parser.add_argument("--sequences", type=int, default=None, help="sequences per batch (one optimizer step); "
                                                                    "default 512")
    parser.add_argument("--prompt-length", type=int, default=None, help="prompt tokens of every sequence; default 128")
    parser.add_argument("--response-length", type=int, default=None,
                        help="response tokens of every sequence in the fixed workload; default 256")
    parser.add_argument("--min-response", type=int, default=None,
                        help="shortest response of the mixed workload; default 32")
    parser.add_argument("--max-response", type=int, default=None,
                        help="longest response of the mixed workload; default 1024")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per micro-batch without dynamic bsz, fixed workload; default 32")
    parser.add_argument("--mixed-micro-batch", type=int, default=None,
                        help="sequences per micro-batch without dynamic bsz, mixed workload; default 8 (padded to "
                             "128 + 1024 tokens, 32 sequences would hold 20 GiB of fp32 logits: beyond 80 GB)")
    parser.add_argument("--max-token-len", type=int, default=None,
                        help="tokens per micro-batch with dynamic bsz (ppo_max_token_len_per_gpu); default 16384")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, per row; default 1")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row; default 3")
    parser.add_argument("--workload", choices=("fixed", "mixed", "both"), default="both", help="workloads to run")
    parser.add_argument("--settings", default=None,
                        help="comma-separated row numbers to run (1-based, in table order); default all")
    parser.add_argument("--attn-implementation", default="sdpa",
                        help="the engine's attention kernel (flash_attention_2 where installed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--commit", default=None, help="commit to report; default: `git rev-parse --short HEAD`")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else dict(
        shape="qwen2.5-0.5b", sequences=512, prompt_length=128, response_length=256, min_response=32,
        max_response=1024, micro_batch=32, mixed_micro_batch=8, max_token_len=16384, warmup=1, steps=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def chosen_settings(selection: str | None) -> list[Setting]:
    if selection is None:
        return list(SETTINGS)
    numbers = [int(number) for number in selection.split(",")]
    if not all(1 <= number <= len(SETTINGS) for number in numbers):
        raise SystemExit(f"--settings {selection}: rows are numbered 1 to {len(SETTINGS)}: "
                         + ", ".join(f"{index} {setting.name}" for index, setting in enumerate(SETTINGS, 1)))
    return [SETTINGS[number - 1] for number in numbers]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = RunOptions(max_token_len=args.max_token_len, warmup=args.warmup,
                         steps=args.steps, compute_dtype=compute_dtype("auto"), master_dtype=MASTER_DTYPE,
                         attn_implementation=args.attn_implementation, seed=args.seed)
    options.check()
    workloads = [workload for workload in (
        TrainWorkload("fixed", args.sequences, args.prompt_length, args.response_length, args.response_length,
                      args.micro_batch),
        TrainWorkload("mixed", args.sequences, args.prompt_length, args.min_response, args.max_response,
                      args.mixed_micro_batch),
    ) if args.workload in (workload.name, "both")]
    for workload in workloads:
        workload.check()
    moe = SHAPES[args.shape or "tiny"].get("arch", "").endswith("_moe")
    settings = [setting for setting in chosen_settings(args.settings)
                if (accelerator_available() or not setting.needs_accelerator) and (moe or not setting.expert_loop)]
    env = environment(args.commit or git_commit(REPO_DIR))
    summaries = []
    with tempfile.TemporaryDirectory(prefix="ember-train-bench-") as work_dir:
        tokenizer = train_tiny_tokenizer()
        dtype = torch.bfloat16 if accelerator_available() else torch.float32
        model_dir = build_model_dir(args.shape, tokenizer, f"{work_dir}/model", dtype, args.seed)
        vocab_size = SHAPES[args.shape].get("vocab_size", len(tokenizer))
        for workload in workloads:
            batches = make_batches(workload, options.warmup + options.steps, len(tokenizer), tokenizer.pad_token_id,
                                   args.seed)
            summaries += [run_setting(setting, workload, model_dir, batches, vocab_size, options)
                          for setting in settings]
    print()
    print(format_train_report(env, workloads, options, args.shape, summaries))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report_json(env, BenchmarkSpec(options, tuple(workloads)), args.shape, summaries), handle,
                      indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
