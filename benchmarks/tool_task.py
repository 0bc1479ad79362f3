"""Tool use where the tool makes the answer reachable: three-digit multiplication with and without ember's
calculator (`ember/agent/tools/calculator.py`), on ember's engine and agent loop (`ember/agent/loop.py`).

    python benchmarks/tool_task.py --gguf /models/SmolLM2-135M-Instruct-Q4_1.gguf --prompts 256
    python benchmarks/tool_task.py --tiny --device cpu --prompts 4 --response-length 48    # CPU smoke, no numbers

Rows, all on the same prompts (greedy decoding, so a row's accuracy is a property of the model), each prompt
preceded by one worked exchange (123 * 456, computed by hand or through the calculator):
- `single-turn`: the model answers without tools (the system prompt asks it to compute by itself);
- `calculator, N ms`: the system prompt describes the calculator and how to call it (Hermes `<tool_call>`
  JSON) and the worked exchange shows a call and its tool turn; the agent loop runs its calls (after N ms of added latency per call, a tool that sleeps in its
  thread, as a remote tool would) and appends the answers as tool turns;
- `single-turn, same length`: the engine generating as many tokens per sample as the calculator rows' model
  turns had on average (EOS ignored): the throughput the tool turns are measured against.

Columns: accuracy (the last number of the model's own tokens, tool turns excluded, equals the product: the
gsm8k scorer's flexible rule), tool calls and turns per sample, model tokens per sample, and generation
tokens/s (model tokens, i.e. response_mask 1, over the wall time of the whole batch, tool time included).
Accuracy before and after RL is not measured here: train with `ember train` (rollout.multi_turn with the
calculator's tool config) and point --model-dir at the exported model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from ember.agent import AgentLoop, AgentOptions
from ember.agent.tools.calculator import SCHEMA as CALCULATOR
from ember.agent.tools.calculator import CalculatorTool
from ember.data.preprocess.synthetic import calculator_prompt
from ember.inference.config import EngineConfig
from ember.inference.engine import LLMEngine
from ember.inference.request import SamplingParams
from ember.models.gguf import save_gguf_as_hf
from ember.models.tiny import build_tiny_model, train_tiny_tokenizer
from ember.rewards.gsm8k import compute_score

WITHOUT_TOOL = "Compute the answer yourself, step by step. Give the final answer after ####."
EXAMPLE_WITHOUT_TOOL = [  # the calculator prompt's worked exchange, computed by hand
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "content": "123 * 456 = 123 * 400 + 123 * 56 = 49200 + 6888 = 56088\n#### 56088"}]


class SlowCalculator(CalculatorTool):
    """The calculator after `config["latency_s"]` seconds in its worker thread (a remote tool's round trip)."""

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(self.config.get("latency_s", 0.0))
        return await super().execute(instance_id, parameters, **kwargs)


@dataclass
class Row:
    name: str
    accuracy: float
    tool_calls: float
    turns: float
    model_tokens: float
    tokens_per_s: float


def multiplication_problems(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(count)]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def is_correct(tokenizer, model_tokens: list[int], a: int, b: int) -> bool:
    text = tokenizer.decode(model_tokens, skip_special_tokens=True)
    return compute_score(text, str(a * b), method="flexible", format_score=0.0, score=1.0) == 1.0


def run_single_turn(engine, tokenizer, problems, sampling) -> Row:
    prompts = [prompt_ids(tokenizer, [{"role": "system", "content": WITHOUT_TOOL}, *EXAMPLE_WITHOUT_TOOL,
                                      {"role": "user", "content": f"What is {a} * {b}?"}]) for a, b in problems]
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = [output.generated_token_ids for output in outputs]
    correct = sum(is_correct(tokenizer, ids, a, b) for ids, (a, b) in zip(tokens, problems))
    total = sum(map(len, tokens))
    return Row("single-turn", correct / len(problems), 0.0, 1.0, total / len(problems), total / seconds)


def run_with_calculator(engine, tokenizer, problems, sampling, latency_ms: float) -> Row:
    tool = SlowCalculator({"latency_s": latency_ms / 1000}, CALCULATOR)
    loop = AgentLoop(engine, tokenizer, {"calculator": tool}, AgentOptions(max_assistant_turns=4))
    prompts = [prompt_ids(tokenizer, calculator_prompt(f"What is {a} * {b}?")) for a, b in problems]
    start = time.perf_counter()
    outputs = loop.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    model_tokens = [[token for token, mask in zip(output.token_ids, output.response_mask) if mask]
                    for output in outputs]
    correct = sum(is_correct(tokenizer, ids, a, b) for ids, (a, b) in zip(model_tokens, problems))
    total = sum(map(len, model_tokens))
    return Row(f"calculator, {latency_ms:g} ms", correct / len(problems),
               sum(output.agent.tool_calls for output in outputs) / len(outputs),
               sum(output.agent.assistant_turns for output in outputs) / len(outputs), total / len(problems),
               total / seconds)


def run_same_length(engine, tokenizer, problems, sampling, length: int) -> Row:
    prompts = [prompt_ids(tokenizer, calculator_prompt(f"What is {a} * {b}?")) for a, b in problems]
    fixed = SamplingParams(do_sample=False, max_new_tokens=max(1, length), ignore_eos=True, seed=sampling.seed)
    start = time.perf_counter()
    outputs = engine.generate(prompts, fixed)
    seconds = time.perf_counter() - start
    total = sum(len(output.generated_token_ids) for output in outputs)
    return Row("single-turn, same length", float("nan"), 0.0, 1.0, total / len(problems), total / seconds)


def model_dir(args, workdir: str) -> str:
    """An HF folder the engine loads: --model-dir as given, a GGUF file dequantised to one, or the tiny model."""
    if args.model_dir:
        return args.model_dir
    if args.tiny:
        directory = os.path.join(workdir, "tiny")
        build_tiny_model("qwen2", train_tiny_tokenizer(), out_dir=directory, seed=0)
        return directory
    return save_gguf_as_hf(args.gguf, os.path.join(workdir, "model"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a GGUF model file (e.g. SmolLM2-135M-Instruct's), dequantised to bf16")
    source.add_argument("--model-dir", help="a Hugging Face model folder (e.g. one ember exported after RL)")
    source.add_argument("--tiny", action="store_true", help="ember's tiny random model (a smoke run)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=256, help="most tokens per sample, tool turns included")
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 50.0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ember-tool-task-") as workdir:
        directory = model_dir(args, workdir)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None, tokenizer.unk_token_id}
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        engine = LLMEngine.from_pretrained(directory, EngineConfig(
            max_model_len=512 + args.response_length, max_num_seqs=args.prompts, dtype=dtype, device=args.device,
            use_cuda_graphs=args.device.startswith("cuda")))
        problems = multiplication_problems(args.prompts, args.seed)
        sampling = SamplingParams(do_sample=False, max_new_tokens=args.response_length,
                                  stop_token_ids=tuple(sorted(stops)), seed=args.seed)
        # Warm-up, untimed: every batch size the timed rows pass through captures its decode graph here (a
        # calculator row's batch shrinks through sizes the single-turn row never reaches).
        run_single_turn(engine, tokenizer, problems, sampling)
        run_with_calculator(engine, tokenizer, problems, sampling, 0.0)
        rows = [run_single_turn(engine, tokenizer, problems, sampling)]
        rows += [run_with_calculator(engine, tokenizer, problems, sampling, latency) for latency in args.latencies_ms]
        tool_rows = rows[1:]
        rows.append(run_same_length(engine, tokenizer, problems, sampling,
                                    round(sum(row.model_tokens for row in tool_rows) / len(tool_rows))))

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"three-digit multiplication, {args.prompts} prompts, greedy, {args.response_length} tokens, "
          f"{args.gguf or args.model_dir or 'tiny model'} on {device}\n")
    print("| row | accuracy | tool calls/sample | model turns/sample | model tokens/sample | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row.name} | {row.accuracy:.3f} | {row.tool_calls:.2f} | {row.turns:.2f} | {row.model_tokens:.1f} "
              f"| {row.tokens_per_s:.0f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump([row.__dict__ for row in rows], handle, indent=1)


if __name__ == "__main__":
    main()
