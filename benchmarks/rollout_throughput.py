"""Rollout throughput: ember's generation engine, on one GPU or split over several (rollout tensor
parallelism), against transformers `generate`; same model, prompts and sampling in one run (random
weights of a real model's shape, 128-token prompts, 256 sampled tokens each with EOS ignored,
temperature 1; `--top-p` / `--top-k` cut every engine's draws, e.g. to see what truncation costs a step).

    python benchmarks/rollout_throughput.py [--rows 64 512] [--shapes qwen2.5-0.5b ...] [--hf-rows 64 512]
    python benchmarks/rollout_throughput.py --shapes qwen2.5-1.5b qwen2.5-7b --layouts 1x1 2x1 1x2 4x1 1x4 --hf-rows
    python benchmarks/rollout_throughput.py --device cpu --shapes tiny --rows 4 --response-length 8 --layouts 1x1 2x1
    python benchmarks/rollout_throughput.py --rows 64 512 --hf-rows --quantization fp8   # FP8 rows beside bf16

Prints one table row per shape, batch size and engine: tokens/s, peak GPU memory (the fullest rank),
and ms per decode step (from a second, prefill-only run: (full - prefill) / (tokens - 1)); for ember
on one GPU also the captured decode step replayed alone (`graph ms`: the device's time per step
without the host's work between windows, at a context of one token: every row reads the trash block, so
attention does almost nothing and the figure is a floor for the step, not the step; `--profile` gives the
kernels at the generate's own contexts).

A layout TPxR is R replicas of ember's engine, each split over TP GPUs (rollout.tensor_model_parallel_size),
on TP·R GPUs; each replica generates rows/R of the prompts, so `2x1` against `1x2` is one engine
split over two GPUs against two engines of one GPU each, on the same batch. `step vs 1x1` is the
decode step's time against one engine on one GPU (the issue's goal for TP=2 at 64 rows on the 7B
shape: at most 0.6). Layouts of more than one GPU run in a fresh `torchrun` launch of this script
(one process per GPU, NCCL; gloo on CPU), timed from a barrier of all ranks to the next; their
decode steps are CUDA graphs with the NCCL collectives inside (`--eager` for none). transformers runs on one GPU only.
`--device cpu` runs everything on the CPU in fp32 (a smoke test of the script, not a measurement).
`--quantization fp8` runs every ember layout a second time with rollout.quantization=fp8 (FP8 weights,
`ember/inference/models/fp8.py`), its row beside the unquantised one, and `step vs 1x1` then compares
its decode step with the unquantised engine's on one GPU; `KV blocks` shows the cache each engine sized
(more where FP8's smaller weights leave room and the cache is memory-bound, not capped by max_num_seqs).
`--profile DIR` also writes, for every ember row, where one decode step's device time goes: the torch
profiler's kernel times of a 33-token generate (at most the response length) minus those of a 1-token one (the prefill), per decode step,
largest first (`DIR/SHAPE-TPxR-ROWS[-fp8].txt`, rank 0's kernels; CUDA graphs' kernels included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from common import SHAPES, build_model_dir  # benchmarks/common.py: a script's own folder is on sys.path
from ember.distributed.device import (current_device, empty_cache, init_distributed, is_distributed, rank,
                                      request_device, shutdown_distributed, synchronize, world_size)
from ember.inference.config import EngineConfig
from ember.inference.engine import LLMEngine
from ember.models.tiny import train_tiny_tokenizer
from ember.rollout import HFRollout, SamplingParams

PROMPT_LENGTH = 128


def parse_layout(text: str) -> tuple[int, int]:
    """(tensor-parallel size, replicas) of a layout written TPxR, e.g. 2x1."""
    parts = text.split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"layout {text!r}: write TPxR (GPUs per engine x engines), e.g. 2x1 or 1x2")
    return int(parts[0]), int(parts[1])


def wait_for_every_rank() -> None:
    synchronize()
    if is_distributed():
        dist.barrier()


def timed_generate(generate, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Seconds of one generate call on every rank, after a short warm-up call on the same prompts (which also
    captures the decode graph of this batch size: a capture inside the timed call would count as decode time)."""
    generate(prompts, SamplingParams(n=1, max_new_tokens=8, ignore_eos=True, temperature=1.0))
    wait_for_every_rank()
    start = time.perf_counter()
    generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=1.0))
    wait_for_every_rank()
    return time.perf_counter() - start


def measure(generate, prompts: list[list[int]], total_rows: int, response_length: int) -> dict[str, float]:
    """tokens/s (of all ranks' `total_rows`), peak memory (GiB, the fullest rank) and decode ms per step of
    one engine (or one per replica) generating `prompts` (this replica's share)."""
    on_cuda = current_device().type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    full_s = timed_generate(generate, prompts, response_length)
    prefill_s = timed_generate(generate, prompts, 1)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0], device=current_device())
    if is_distributed():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"tok_s": total_rows * response_length / full_s, "seconds": full_s, "peak_gib": float(peak),
            "step_ms": 1000 * (full_s - prefill_s) / (response_length - 1)}


def truncated(generate, args):
    """`generate` with every call's sampling cut to `--top-p` / `--top-k` (both off by default)."""
    return lambda prompts, sampling: generate(prompts, replace(sampling, top_p=args.top_p, top_k=args.top_k))


def graph_step_ms(engine: LLMEngine, rows: int, args, replays: int = 200) -> float:
    """ms per replay of the decode step captured for `rows` rows (padding rows on the trash block: a context of one
    token, so attention's share of a real step is left out)."""
    decoder = engine.decoder
    padded = next(size for size in decoder.batch_sizes if size >= rows)
    graph = decoder._graph(padded, SamplingParams(temperature=1.0, top_p=args.top_p, top_k=args.top_k))
    decoder._load_rows([], padded)  # padding rows from position 0: the replays stay inside max_model_len
    for _ in range(10):
        graph.replay()
    synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    synchronize()
    return 1000 * (time.perf_counter() - start) / replays


def kernel_times(generate, prompts: list[list[int]], max_new_tokens: int) -> dict[str, tuple[float, int]]:
    """(device µs, calls) by kernel name of one generate call under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if current_device().type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=1.0))
        synchronize()
    times = {}
    for event in profiler.events():
        device_us = event.device_time_total if activities[0] == ProfilerActivity.CUDA else event.cpu_time_total
        if event.device_type.name == activities[0].name and device_us > 0:
            total, calls = times.get(event.name, (0.0, 0))
            times[event.name] = (total + device_us, calls + 1)
    return times


def write_decode_profile(generate, prompts: list[list[int]], path: str, steps: int = 32) -> None:
    """Per decode step: device µs and calls of each kernel (a (steps+1)-token generate minus a 1-token one)."""
    full, prefill = kernel_times(generate, prompts, steps + 1), kernel_times(generate, prompts, 1)
    rows = []
    for name, (total, calls) in full.items():
        base_total, base_calls = prefill.get(name, (0.0, 0))
        rows.append(((total - base_total) / steps, (calls - base_calls) / steps, name))
    rows.sort(reverse=True)
    step_us = sum(us for us, _, _ in rows)
    with open(path, "w") as handle:
        handle.write(f"device time per decode step: {step_us:.1f} us (kernels only: gaps between kernels not counted; "
                     "a negative row ran more in the 1-token generate, work of a run rather than of a step)\n")
        handle.write(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel\n")
        for us, calls, name in rows:
            if abs(us) > 0.05:
                handle.write(f"{us:9.1f} {100 * us / step_us:5.1f}% {calls:6.1f}  {name[:160]}\n")


def bench_prompts(rows: int) -> list[list[int]]:
    """The same `rows` random prompts in every process."""
    generator = torch.Generator().manual_seed(rows)
    return [torch.randint(10, 400, (PROMPT_LENGTH,), generator=generator).tolist() for _ in range(rows)]


def run_ember(model_dir: str, rows: int, tensor_parallel: int, replicas: int, args,
              quantization: str | None) -> dict[str, float]:
    """ember's engine (weights quantised as `quantization` says) in this process's place of a TPxR layout
    (world size TP·R) on `rows` prompts: each replica takes its consecutive share, every rank of a replica
    the same one."""
    if rows % replicas:
        raise SystemExit(f"--rows {rows} does not divide over {replicas} replicas")
    share = rows // replicas
    replica = rank() // tensor_parallel
    prompts = bench_prompts(rows)[replica * share : (replica + 1) * share]
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        max_model_len=PROMPT_LENGTH + args.response_length, max_num_seqs=max(args.rows),
        max_num_batched_tokens=65536, dtype=args.dtype, device=str(current_device()),
        use_cuda_graphs=not args.eager, decode_window=args.decode_window, tensor_parallel_size=tensor_parallel,
        quantization=quantization, gpu_memory_utilization=args.gpu_memory_utilization))
    result = measure(truncated(engine.generate, args), prompts, rows, args.response_length)
    result["kv_blocks"] = engine.num_kv_blocks
    if args.profile:
        label = f"{args.shape}-{tensor_parallel}x{replicas}-{rows}" + (f"-{quantization}" if quantization else "")
        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, label + ".txt")
        write_decode_profile(truncated(engine.generate, args), prompts, path if rank() == 0 else os.devnull,
                             steps=min(32, args.response_length - 1))
    if engine.decoder.use_cuda_graphs:
        result["graph_ms"] = graph_step_ms(engine, share, args)
    del engine
    empty_cache()
    return result


def run_layout_worker(args) -> None:
    """One rank of a torchrun launch for `--worker-layout`: every --rows at that layout, results (JSON lines)
    written by rank 0 to --result-file."""
    tensor_parallel, replicas = args.worker_layout
    init_distributed()
    if world_size() != tensor_parallel * replicas:
        raise SystemExit(f"layout {tensor_parallel}x{replicas} needs {tensor_parallel * replicas} ranks, "
                         f"got {world_size()}")
    results = [dict(rows=rows, **run_ember(args.model_dir, rows, tensor_parallel, replicas, args,
                                           args.worker_quantization)) for rows in args.rows]
    if rank() == 0:
        with open(args.result_file, "w") as handle:
            handle.writelines(json.dumps(result) + "\n" for result in results)
    shutdown_distributed()


def launch_layout(layout: tuple[int, int], model_dir: str, args, quantization: str | None) -> dict[int, dict[str, float]]:
    """Results by rows of a layout of several GPUs, from a fresh torchrun launch of this script."""
    gpus = layout[0] * layout[1]
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as result_file:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                   os.path.abspath(__file__), "--worker-layout", f"{layout[0]}x{layout[1]}", "--model-dir", model_dir,
                   "--result-file", result_file.name, "--device", args.device, "--rows", *map(str, args.rows),
                   "--response-length", str(args.response_length), "--decode-window", str(args.decode_window),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--top-p", str(args.top_p),
                   "--top-k", str(args.top_k)]
        command += ["--worker-quantization", quantization] if quantization else []
        command += ["--profile", args.profile, "--shape", args.shape] if args.profile else []
        subprocess.run(command + (["--eager"] if args.eager else []), check=True)
        with open(result_file.name) as handle:
            return {result.pop("rows"): result for result in map(json.loads, handle)}


def engine_name(layout: tuple[int, int], quantization: str | None) -> str:
    tensor_parallel, replicas = layout
    name = f"ember TP={tensor_parallel}" if replicas == 1 else f"ember {replicas} × TP={tensor_parallel}"
    return f"{name} {quantization}" if quantization else name


def print_row(shape: str, rows: int, name: str, result: dict[str, float], single: dict[str, float] | None) -> None:
    graph_cell = f"{result['graph_ms']:.2f}" if "graph_ms" in result else ""
    peak_cell = f"{result['peak_gib']:.1f}" if result["peak_gib"] else ""
    ratio_cell = f"{result['step_ms'] / single['step_ms']:.2f}" if single is not None and result is not single else ""
    print(f"| {shape} | {rows} | {name} | {result['tok_s']:,.0f} | {result['seconds']:.2f} | {peak_cell} | "
          f"{result['step_ms']:.2f} | {ratio_cell} | {graph_cell} | {result.get('kv_blocks', '')} |", flush=True)


def run_shape(shape: str, tokenizer, args, hf_rows: list[int]) -> None:
    """Every layout and batch size of one model shape, printed as table rows."""
    model_dir = tempfile.mkdtemp()
    build_model_dir(shape, tokenizer, model_dir, args.dtype, seed=0)
    quantizations = [None] + ([args.quantization] if args.quantization else [])
    by_layout = {}
    for layout in args.layouts:
        for quantization in quantizations:
            if layout == (1, 1):
                by_layout[layout, quantization] = {rows: run_ember(model_dir, rows, 1, 1, args, quantization)
                                                   for rows in args.rows}
            else:
                by_layout[layout, quantization] = launch_layout(layout, model_dir, args, quantization)
    for rows in args.rows:
        single = by_layout.get(((1, 1), None), {}).get(rows)
        for layout in args.layouts:
            for quantization in quantizations:
                print_row(shape, rows, engine_name(layout, quantization), by_layout[layout, quantization][rows], single)
        if rows in hf_rows:
            rollout = HFRollout.from_pretrained(model_dir, pad_token_id=tokenizer.pad_token_id, device=current_device(),
                                                dtype=args.dtype)
            result = measure(truncated(rollout.generate, args), bench_prompts(rows), rows, args.response_length)
            del rollout
            empty_cache()
            print_row(shape, rows, "transformers", result, None)
            if single is not None:
                print(f"|  |  | speed-up of ember TP=1 | {single['tok_s'] / result['tok_s']:.1f}x |  |  |  |  |  |  |")


def main() -> None:
    parser = argparse.ArgumentParser(description="Rollout throughput: ember's engine on one GPU or split over "
                                                 "several, against transformers generate.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen2.5-0.5b"])
    parser.add_argument("--layouts", type=parse_layout, nargs="+", default=[(1, 1)],
                        help="ember layouts TPxR: R engines of TP GPUs each (default 1x1)")
    parser.add_argument("--hf-rows", type=int, nargs="*", default=None,
                        help="batch sizes to also run transformers generate at, on one GPU (default: all of --rows)")
    parser.add_argument("--eager", action="store_true", help="ember without CUDA graphs")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for every engine (1 = off)")
    parser.add_argument("--top-k", type=int, default=-1, help="top-k sampling for every engine (-1 = off)")
    parser.add_argument("--decode-window", type=int, default=EngineConfig.decode_window)
    parser.add_argument("--response-length", type=int, default=256, help="sampled tokens per prompt (EOS ignored)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                        help="the engine's share of each GPU's memory, its weights and KV cache together")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto",
                        help="cpu: everything on the CPU in fp32 (a smoke test of the script)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="also run every ember layout with rollout.quantization=fp8, its row beside the unquantised")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="write each ember row's decode-step kernel times (torch profiler) to DIR")
    parser.add_argument("--worker-layout", type=parse_layout, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # inside a layout's launch: the shape, for --profile
    parser.add_argument("--worker-quantization", choices=["fp8"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.response_length < 2:
        parser.error("--response-length must be at least 2 (decode ms per step needs a decode step)")
    request_device(args.device)
    args.dtype = torch.float32 if current_device().type == "cpu" else torch.bfloat16
    if args.worker_layout is not None:
        run_layout_worker(args)
        return
    hf_rows = args.rows if args.hf_rows is None else args.hf_rows
    tokenizer = train_tiny_tokenizer()
    device_name = torch.cuda.get_device_name() if current_device().type == "cuda" else "CPU"
    print(f"device: {device_name}  prompt {PROMPT_LENGTH}, response {args.response_length}, "
          f"{str(args.dtype).removeprefix('torch.')}, temperature 1, top-p {args.top_p}, top-k {args.top_k}", flush=True)
    print("| shape | rows | engine | tokens/s | s | peak GiB | decode ms/step | step vs 1x1 | graph ms | KV blocks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        args.shape = shape
        run_shape(shape, tokenizer, args, hf_rows)


if __name__ == "__main__":
    main()
