"""LoRA on 2 gloo ranks, launched by test_lora_engine.py: `torchrun --nproc_per_node 2 lora_two_ranks_worker.py
MODEL_DIR OUT_DIR`. Each rank takes its half of `make_batch()` for two updates; then every rank streams the
merged weights (each bucket gathered over both), writes the adapter checkpoint and PEFT's adapter folder, and
rank 0 saves the streamed weights to OUT_DIR/result.pt."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
from fsdp_engine_worker import engine_options, make_batch, mean_log_prob_loss

from ember.distributed.device import shutdown_distributed
from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.lora import LoraOptions
from ember.engines.optim import OptimOptions

LORA = LoraOptions(rank=3, alpha=6.0)  # all-linear
OPTIM = OptimOptions(lr=0.05, eps=1e-2, weight_decay=0.0, clip_grad=0.0)


def lora_engine(model_dir: str) -> FSDPEngine:
    return FSDPEngine(replace(engine_options(model_dir, optim=OPTIM), lora=LORA))


def main(model_dir: str, out_dir: str) -> None:
    engine = lora_engine(model_dir)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = make_batch()
    for _ in range(2):
        engine.train_mini_batch(batch.split(len(batch) // world)[rank], mean_log_prob_loss, micro_batch_size=1)
    streams = {trained_only: {name: tensor.clone() for bucket in engine.named_parameters_for_sync(
        bucket_bytes=2048, trained_only=trained_only) for name, tensor in bucket} for trained_only in (True, False)}
    engine.save(os.path.join(out_dir, "checkpoint"))
    engine.export_lora_adapter(os.path.join(out_dir, "adapter"))
    if rank == 0:
        torch.save(streams, os.path.join(out_dir, "result.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
