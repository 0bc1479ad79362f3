"""One Megatron engine under one parallel layout: the worker tests/gpu/test_megatron_parallel_gpu.py launches.

Run as `python -m torch.distributed.run --standalone --nproc_per_node N megatron_parallel_worker.py MODEL_DIR OUT_FILE
[--tp 2] [--pp 2] [--vpp 2] [--cp 2] [--ep 2] [--no-sequence-parallel] [--max-token-len T] [--load DIR] [--save DIR]`.
Every rank (NCCL on CUDA, one GPU each) builds the engine, takes its data-parallel share of `make_batch(samples=8)`
(the whole batch when DP = 1), computes log-probs, makes one update with the gradient-revealing optimizer and computes
log-probs again. `--load` loads a checkpoint first; `--save` saves one after the update and then makes one more update.
Rank 0 writes the whole batch's log-probs (each data-parallel rank's share gathered, in batch order), the updates'
metrics and whether megatron-core ran with sequence parallelism to OUT_FILE.

A separate process per layout because megatron-core's parallel state is set once per process (`parallel.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared batch and loss

from integration.fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, make_batch, mean_log_prob_loss  # noqa: E402

from ember.data.batch import Batch  # noqa: E402
from ember.distributed.device import current_device, shutdown_distributed  # noqa: E402
from ember.engines.base import MicroBatchSpec  # noqa: E402
from ember.engines.megatron.engine import MegatronEngine  # noqa: E402
from ember.engines.megatron.options import MegatronOptions  # noqa: E402

SAMPLES = 8
MICRO_BATCH_SIZE = 2
"""Samples per micro-batch: 4 micro-batches on one data-parallel rank, 2 on each of two. The interleaved
pipeline schedule needs a micro-batch count that is a multiple of the pipeline size."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="HF model folder the engine starts from")
    parser.add_argument("out_file", help="where rank 0 writes the log-probs and metrics (torch.save)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual_pipeline_model_parallel_size")
    parser.add_argument("--cp", type=int, default=1, help="context_parallel_size")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                        help="shard activations along the sequence in tensor-parallel regions (acts when TP > 1)")
    parser.add_argument("--max-token-len", type=int, default=None,
                        help="micro-batches by this token budget instead of MICRO_BATCH_SIZE samples")
    parser.add_argument("--param-dtype", default="bfloat16", help="the engine's compute dtype (float32 on a CPU)")
    parser.add_argument("--load", default=None, help="checkpoint folder to load before computing")
    parser.add_argument("--save", default=None, help="checkpoint folder to save after the update")
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace) -> MegatronEngine:
    return MegatronEngine(MegatronOptions(
        model_path=args.model_dir, optim=GRADIENT_REVEALING_OPTIM, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
        context_parallel_size=args.cp, expert_model_parallel_size=args.ep, sequence_parallel=args.sequence_parallel,
        param_dtype=args.param_dtype))


def whole_batch_log_probs(engine: MegatronEngine, share: Batch, micro: int | MicroBatchSpec) -> torch.Tensor:
    """The log-probs of this rank's `share`, gathered over the data-parallel ranks in rank order (the whole
    batch), on the CPU. Every stage of a pipeline returns the last stage's outputs, so rank 0 holds them."""
    local = engine.forward(share, micro_batch_size=micro).log_probs.to(current_device())
    parts = [torch.empty_like(local) for _ in range(engine.dp_size)]
    dist.all_gather(parts, local, group=engine.dp_group)
    return torch.cat(parts).cpu()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = build_engine(args)
    if args.load:
        engine.load(args.load)
    micro = MicroBatchSpec(max_token_len=args.max_token_len) if args.max_token_len else MICRO_BATCH_SIZE
    batch = make_batch(samples=SAMPLES)
    share = batch.split(len(batch) // engine.dp_size)[engine.dp_rank]
    result = {"sequence_parallel": engine.config.sequence_parallel,
              "before": whole_batch_log_probs(engine, share, micro)}
    result["metrics"] = engine.train_mini_batch(share, mean_log_prob_loss, micro_batch_size=micro)
    result["after"] = whole_batch_log_probs(engine, share, micro)
    if args.save:
        engine.save(args.save)
        result["next_metrics"] = engine.train_mini_batch(share, mean_log_prob_loss, micro_batch_size=micro)
        result["next_after"] = whole_batch_log_probs(engine, share, micro)
    if dist.get_rank() == 0:
        torch.save(result, args.out_file)
    shutdown_distributed()


if __name__ == "__main__":
    main()
