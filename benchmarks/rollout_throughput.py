"""Rollout throughput: ember's generation engine against transformers `generate`, same
model, prompts and sampling, in one run (random bf16 weights of a real model's shape,
128-token prompts, 256 sampled tokens each with EOS ignored, temperature 1).

    python benchmarks/rollout_throughput.py [--rows 64 512] [--shapes qwen2.5-0.5b ...] [--hf-rows 64 512]

Prints one table row per shape and batch size: tokens/s, peak GPU memory, and ms per
decode step (from a second, prefill-only run: (full - prefill) / (tokens - 1)), for ember
(CUDA graphs, `--eager` for without) and for transformers where asked; for ember also the
captured decode step replayed alone (`graph ms`: the device's time per step without the
host's work between windows). Needs an accelerator.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from common import SHAPES, build_model_dir  # benchmarks/common.py: a script's own folder is on sys.path
from ember.distributed.device import current_device, empty_cache, synchronize
from ember.inference.config import EngineConfig
from ember.inference.engine import LLMEngine
from ember.models.tiny import train_tiny_tokenizer
from ember.rollout import HFRollout, SamplingParams

PROMPT_LENGTH, RESPONSE_LENGTH = 128, 256


def timed_generate(generate, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Seconds of one generate call, after a short warm-up call on the same prompts (which also captures
    the decode graph of this batch size: a capture inside the timed call would count as decode time)."""
    generate(prompts, SamplingParams(n=1, max_new_tokens=8, ignore_eos=True, temperature=1.0))
    synchronize()
    start = time.perf_counter()
    generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=1.0))
    synchronize()
    return time.perf_counter() - start


def measure(generate, prompts: list[list[int]]) -> dict[str, float]:
    """tokens/s, peak memory (GiB) and decode ms per step of one engine on `prompts`."""
    torch.cuda.reset_peak_memory_stats()
    full_s = timed_generate(generate, prompts, RESPONSE_LENGTH)
    prefill_s = timed_generate(generate, prompts, 1)
    return {"tok_s": len(prompts) * RESPONSE_LENGTH / full_s, "seconds": full_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "step_ms": 1000 * (full_s - prefill_s) / (RESPONSE_LENGTH - 1)}


def graph_step_ms(engine: LLMEngine, rows: int, replays: int = 200) -> float:
    """ms per replay of the decode step captured for `rows` rows (padding rows on the trash block)."""
    decoder = engine.decoder
    padded = next(size for size in decoder.batch_sizes if size >= rows)
    graph = decoder._graph(padded, SamplingParams(temperature=1.0))
    decoder._load_rows([], padded)  # padding rows from position 0: the replays stay inside max_model_len
    for _ in range(10):
        graph.replay()
    synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    synchronize()
    return 1000 * (time.perf_counter() - start) / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen2.5-0.5b"])
    parser.add_argument("--hf-rows", type=int, nargs="*", default=None,
                        help="batch sizes to also run transformers generate at (default: all of --rows)")
    parser.add_argument("--eager", action="store_true", help="ember without CUDA graphs")
    parser.add_argument("--decode-window", type=int, default=EngineConfig.decode_window)
    args = parser.parse_args()
    hf_rows = args.rows if args.hf_rows is None else args.hf_rows
    tokenizer = train_tiny_tokenizer()
    generator = torch.Generator().manual_seed(0)
    device = current_device()
    print(f"device: {torch.cuda.get_device_name()}  prompt {PROMPT_LENGTH}, response {RESPONSE_LENGTH}, bf16", flush=True)
    print("| shape | rows | engine | tokens/s | s | peak GiB | decode ms/step | graph ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        model_dir = tempfile.mkdtemp()
        build_model_dir(shape, tokenizer, model_dir, torch.bfloat16, seed=0)
        for rows in args.rows:
            prompts = [torch.randint(10, 400, (PROMPT_LENGTH,), generator=generator).tolist() for _ in range(rows)]
            engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
                max_model_len=PROMPT_LENGTH + RESPONSE_LENGTH, max_num_seqs=max(args.rows),
                max_num_batched_tokens=65536, dtype=torch.bfloat16, device=str(device),
                use_cuda_graphs=not args.eager, decode_window=args.decode_window))
            results = {"ember": measure(engine.generate, prompts)}
            if engine.decoder.use_cuda_graphs:
                results["ember"]["graph_ms"] = graph_step_ms(engine, rows)
            del engine
            empty_cache()
            if rows in hf_rows:
                rollout = HFRollout.from_pretrained(model_dir, pad_token_id=tokenizer.pad_token_id, device=device,
                                                    dtype=torch.bfloat16)
                results["transformers"] = measure(rollout.generate, prompts)
                del rollout
                empty_cache()
            for name, result in results.items():
                graph_cell = f"{result['graph_ms']:.2f}" if "graph_ms" in result else ""
                print(f"| {shape} | {rows} | {name} | {result['tok_s']:,.0f} | {result['seconds']:.2f} | "
                      f"{result['peak_gib']:.1f} | {result['step_ms']:.2f} | {graph_cell} |", flush=True)
            if "transformers" in results:
                print(f"|  |  | speed-up | {results['ember']['tok_s'] / results['transformers']['tok_s']:.1f}x |  |  |  |  |")


if __name__ == "__main__":
    main()
