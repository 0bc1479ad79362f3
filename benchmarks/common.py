"""What every benchmark of a training step shares: the workload, the model and prompts it runs
on, the machine it ran on, and the tables it prints.

The one thing to know: every framework under comparison gets byte-identical inputs. The
model is one HF directory with random weights, the prompts are one list of chat messages
whose rendered form has exactly `prompt_length` tokens, and the reward is one function in
one file (a fixed pseudo-random 0/1 per response text, so GRPO advantages are nonzero
without any task to solve). Only the framework code differs.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerBase

from ember.data.parquet import write_parquet
from ember.distributed.device import device_type, empty_cache
from ember.models.tiny import END_OF_TEXT, tiny_model_config

# Qwen2.5-0.5B's architecture (its config.json), with random weights.
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)

QWEN25_15B_SHAPE = dict(QWEN25_05B_SHAPE, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2)
QWEN25_7B_SHAPE = dict(QWEN25_05B_SHAPE, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)

# SmolLM2-135M-Instruct's architecture (Llama; its config.json), with random weights: the small model of
# the step-cost work (a step of short answers is mostly fixed costs).
SMOLLM2_135M_SHAPE = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192, rope_theta=100_000.0, rms_norm_eps=1e-5)

# Qwen1.5-MoE-A2.7B's architecture (Qwen2-MoE: 60 routed experts, top-4, and a shared expert with its gate).
QWEN15_MOE_A27B_SHAPE = dict(arch="qwen2_moe", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                             tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=1_000_000.0,
                             rms_norm_eps=1e-6, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                             shared_expert_intermediate_size=5632, decoder_sparse_step=1, norm_topk_prob=False)

# Qwen3-0.6B's architecture (Qwen3: q/k norms, head size 128 apart from hidden / heads).
QWEN3_06B_SHAPE = dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6)

# Model shapes by name: config fields on top of ember's tiny model of the shape's `arch` (qwen2 by default;
# hidden 64, 2 layers).
SHAPES: dict[str, dict] = {"tiny": {}, "tiny-moe": {"arch": "qwen2_moe"}, "qwen2.5-0.5b": QWEN25_05B_SHAPE, "qwen2.5-1.5b": QWEN25_15B_SHAPE,
                           "qwen2.5-7b": QWEN25_7B_SHAPE, "smollm2-135m": SMOLLM2_135M_SHAPE,
                           "qwen1.5-moe-a2.7b": QWEN15_MOE_A27B_SHAPE,
                           # its first 4 layers: 14B parameters with fp32 Adam do not fit one 80 GB GPU; 4 do
                           "qwen1.5-moe-a2.7b-4l": dict(QWEN15_MOE_A27B_SHAPE, num_hidden_layers=4),
                           # 2 layers: Megatron's fp32 masters and Adam state of 4 leave no KV cache on one 80 GB GPU
                           "qwen1.5-moe-a2.7b-2l": dict(QWEN15_MOE_A27B_SHAPE, num_hidden_layers=2),
                           "qwen3-0.6b": QWEN3_06B_SHAPE}

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ember checkout holding benchmarks/

FAST_TRAINING = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.use_fused_kernels=True",
                 "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=49152",
                 "actor_rollout_ref.model.use_liger=True"]
"""ember's fastest training switches on the GPU step (BENCHMARKS.md): packed micro-batches in a 48k token budget,
fused log-probs, Liger's kernels (`pip install liger-kernel`)."""

DATA_SOURCE = "benchmark"

REWARD_SOURCE = '''"""Benchmark reward: a fixed pseudo-random 0 or 1 per response text (nonzero advantages, no task)."""

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(zlib.crc32(solution_str.encode("utf-8")) % 2)
'''


@dataclass(frozen=True)
class Workload:
    """One GRPO step's shape, the same for every framework."""

    prompts: int  # prompts per step (data.train_batch_size)
    n: int  # responses per prompt (the GRPO group size)
    prompt_length: int  # tokens of every rendered prompt, chat template included
    response_length: int  # tokens of every response (EOS is ignored)
    micro_batch: int  # responses per forward/backward in the update
    warmup: int  # steps run before timing starts
    steps: int  # timed steps; the report gives their median
    gradient_checkpointing: bool = True  # recompute decoder-layer activations in backward (both frameworks)

    @property
    def samples(self) -> int:
        """Responses per step; all of them feed one optimizer step."""
        return self.prompts * self.n

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def check(self) -> None:
        """Stops with a message when the frameworks could not run this workload identically."""
        if min(self.prompts, self.prompt_length, self.response_length, self.micro_batch, self.steps) < 1:
            raise SystemExit("--prompts, --prompt-length, --response-length, --micro-batch and --steps must be >= 1")
        if self.n < 2:
            raise SystemExit(f"--n {self.n}: GRPO needs at least 2 responses per prompt")
        if self.samples % self.micro_batch:
            raise SystemExit(f"--micro-batch {self.micro_batch} does not divide the {self.samples} responses of a step "
                             f"(--prompts × --n); pick a divisor of {self.samples}")


@dataclass
class FrameworkResult:
    """Measurements of one framework over the timed steps (one list entry per step)."""

    framework: str
    step_s: list[float]  # wall clock of each step, device synchronised
    phases_s: dict[str, list[float]]  # per phase name, its time in each step
    tokens_per_step: float  # prompt + response tokens of all samples of one step
    peak_memory_gib: float | None  # peak allocated accelerator memory over the whole run; None on CPU
    notes: dict[str, object] = field(default_factory=dict)  # framework settings worth reporting

    def summary(self) -> dict[str, object]:
        """Medians of the timed steps, as printed and written to JSON."""
        step = statistics.median(self.step_s)
        return {"framework": self.framework, "step_s": step,
                "phases_s": {name: statistics.median(values) for name, values in self.phases_s.items()},
                "tokens_per_s": self.tokens_per_step / step, "tokens_per_step": self.tokens_per_step,
                "peak_memory_gib": self.peak_memory_gib, "step_s_all": self.step_s, "notes": self.notes}


# --- inputs ----------------------------------------------------------------------------------------


def build_model_dir(shape: str, tokenizer: PreTrainedTokenizerBase, out_dir: str, dtype: torch.dtype, seed: int) -> str:
    """Saves a randomly initialised model of `shape` (Qwen2 unless the shape names its `arch`) with
    `tokenizer` as a HF directory.

    The model's vocabulary may be larger than the tokenizer's (the real Qwen shape with the
    tiny tokenizer): ids the tokenizer does not know decode to nothing, which is harmless
    for a speed benchmark.
    """
    overrides = dict(SHAPES[shape])
    vocab_size = overrides.pop("vocab_size", len(tokenizer))
    config = tiny_model_config(overrides.pop("arch", "qwen2"), vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    with torch.device(device_type() if torch.accelerator.is_available() else "cpu"):  # a 7B init takes minutes on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # As the tiny models and Qwen's chat checkpoints do: a turn ends at <|im_end|> or <|endoftext|>.
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=list(dict.fromkeys(stop_ids)),
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def stable_word_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of tokens that are one space-led word and encode back to themselves alone.

    Byte-level BPE splits text at spaces before merging, so any sequence of such tokens
    re-encodes to exactly the same ids: that is what makes a prompt's length exact.
    """
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" [A-Za-z]+", text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(token_id)
    if len(words) < 2:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has fewer than 2 single-token words to build "
                         "prompts from")
    return words


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat prompt as both frameworks build them: template text, no added special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_prompts(tokenizer: PreTrainedTokenizerBase, count: int, prompt_length: int, seed: int) -> list[list[dict]]:
    """`count` one-turn user chats of random words, each exactly `prompt_length` tokens once rendered."""
    template_length = len(render_prompt_ids(tokenizer, [{"role": "user", "content": ""}]))
    content_length = prompt_length - template_length
    if content_length < 1:
        raise SystemExit(f"--prompt-length {prompt_length}: the chat template alone takes {template_length} tokens; "
                         f"use at least {template_length + 1}")
    words = stable_word_tokens(tokenizer)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        content = tokenizer.decode([rng.choice(words) for _ in range(content_length)])
        messages = [{"role": "user", "content": content}]
        length = len(render_prompt_ids(tokenizer, messages))
        if length != prompt_length:
            raise ValueError(f"a benchmark prompt rendered to {length} tokens instead of {prompt_length}: the chat "
                             f"template of {tokenizer.name_or_path!r} merges tokens across the message boundary")
        prompts.append(messages)
    return prompts


def write_prompt_parquet(prompts: list[list[dict]], path: str) -> str:
    """The prompts as an RL parquet in verl's row format (what `ember train` reads)."""
    rows = [{"data_source": DATA_SOURCE, "prompt": messages, "ability": "benchmark",
             "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": index}}
            for index, messages in enumerate(prompts)]
    return str(write_parquet(rows, path))


def write_reward_file(directory: str) -> str:
    """Writes the benchmark reward function (`compute_score`) to a file; returns its path."""
    path = os.path.join(directory, "benchmark_reward.py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(REWARD_SOURCE)
    return path


# --- the machine -----------------------------------------------------------------------------------


def accelerator_available() -> bool:
    return device_type() != "cpu"


def device_name() -> str:
    kind = device_type()
    if kind == "cpu":
        return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return torch.get_device_module(kind).get_device_name()


def reset_peak_memory() -> None:
    if accelerator_available():
        torch.accelerator.reset_peak_memory_stats()


def allocated_memory_gib() -> float | None:
    """Accelerator memory held by tensors now; None on CPU."""
    if not accelerator_available():
        return None
    return torch.accelerator.memory_allocated() / 2**30


def peak_memory_gib() -> float | None:
    """Peak accelerator memory allocated by tensors since the last reset; None on CPU."""
    if not accelerator_available():
        return None
    return torch.accelerator.max_memory_allocated() / 2**30


def release_ember() -> None:
    """Frees what ember left (its trainer or engine must be unreferenced) so that what runs next starts clean."""
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    empty_cache()


def package_version(name: str) -> str:
    if importlib.util.find_spec(name) is None:
        return "not installed"
    return importlib.metadata.version(name)


def git_commit(repo_dir: str) -> str:
    """Short commit of `repo_dir`, `-dirty` when files differ from it; `unknown` without git or a checkout."""
    if shutil.which("git") is None:
        return "unknown"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_dir, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                            capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def environment(commit: str) -> dict[str, str]:
    return {"device": device_name(), "torch": torch.__version__, "transformers": package_version("transformers"),
            "trl": package_version("trl"), "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# --- the report ------------------------------------------------------------------------------------


def format_number(value: float | None, digits: int) -> str:
    """`value` with `digits` decimals, or "-" where there is none (memory on CPU)."""
    return "-" if value is None else f"{value:.{digits}f}"


def write_results(path: str | None, results) -> None:
    """`results` as JSON at `path` (nothing without one): a script calls it after every run, so a later run that
    fails or times out loses nothing measured before it."""
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_report(title: str, env: dict[str, str], workload: Workload, model: str,
                  summaries: list[dict], main_phases: dict[str, tuple[str, str]]) -> str:
    """The environment, the workload, one row per framework and one row per phase, as Markdown.

    `main_phases[framework]` names that framework's (generation, training) phases for the
    main table's gen and train columns.
    """
    lines = [f"## {title}", "",
             f"{env['date']} · commit {env['commit']} · {env['device']} · torch {env['torch']} · "
             f"transformers {env['transformers']} · TRL {env['trl']} · Python {env['python']}", "",
             f"model {model} · {workload.prompts} prompts × {workload.n} responses · "
             f"prompt {workload.prompt_length} + response {workload.response_length} tokens · "
             f"micro-batch {workload.micro_batch} · one optimizer step per batch · "
             f"gradient checkpointing {'on' if workload.gradient_checkpointing else 'off'} · median of {workload.steps} steps after {workload.warmup} warm-up", ""]
    rows = []
    for summary in summaries:
        gen, train = main_phases[summary["framework"]]
        rows.append([summary["framework"], format_number(summary["step_s"], 2),
                     format_number(summary["phases_s"].get(gen), 2), format_number(summary["phases_s"].get(train), 2),
                     format_number(summary["tokens_per_s"], 0), format_number(summary["peak_memory_gib"], 1)])
    lines.append(markdown_table(["framework", "step (s, median)", "gen (s)", "train (s)", "tokens/s",
                                 "peak memory (GiB)"], rows))
    phase_rows = [[summary["framework"], name, format_number(seconds, 3)]
                  for summary in summaries for name, seconds in summary["phases_s"].items()]
    lines += ["", markdown_table(["framework", "phase", "seconds (median)"], phase_rows)]
    return "\n".join(lines)


def report_json(env: dict[str, str], workload, model: str, summaries: list[dict]) -> dict:
    """The report as JSON: `workload` is any dataclass describing what ran."""
    return {"environment": env, "model": model, "workload": dataclasses.asdict(workload), "results": summaries}
