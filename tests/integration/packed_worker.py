"""The 2-rank worker of tests/integration/test_packed_training.py: packing and fused log-probs
under FSDP2 with the root's weights resharded after forward (as at any world size above 1).

Run as `python -m torch.distributed.run --standalone --nproc_per_node 2 packed_worker.py
MODEL_DIR OUT_DIR`: each rank takes its half of `make_batch(seed=3, samples=8)`, computes
log-probs and entropy, and makes one update with an entropy bonus in the loss, all with
`use_remove_padding` and `use_fused_kernels`; rank 0 writes the gathered outputs, the metrics
and the full updated weights to OUT_DIR/result.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, engine_options, full_weights, make_batch

from ember.data.batch import Batch
from ember.distributed.device import current_device, shutdown_distributed
from ember.engines.base import LossContext, ModelOutput
from ember.engines.fsdp.engine import FSDPEngine

SAMPLES = 8
ENTROPY_COEFF = 0.1


def make_samples() -> Batch:
    return make_batch(seed=3, samples=SAMPLES)


def log_prob_and_entropy_loss(output: ModelOutput, batch: Batch,
                              context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL minus an entropy bonus: gradients reach the LM head through both outputs."""
    mask = batch.response_mask
    token_loss = -output.log_probs - ENTROPY_COEFF * output.entropy
    return (token_loss * mask).sum() / context.num_tokens, {}


def train_once(engine: FSDPEngine, batch: Batch, micro_batch_size) -> dict[str, float]:
    """One update at a sampling temperature other than 1, so its place in every gradient is checked too."""
    return engine.train_mini_batch(batch, log_prob_and_entropy_loss, micro_batch_size,
                                   compute_entropy=True, entropy_grad=True, temperature=0.7)


def main(model_dir: str, out_dir: str) -> None:
    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM,
                                       use_remove_padding=True, use_fused_kernels=True))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = make_samples().split(SAMPLES // world)[rank]
    output = engine.forward(local, micro_batch_size=2, compute_entropy=True)
    gathered = {}
    for name in ("log_probs", "entropy"):
        value = getattr(output, name).to(current_device())
        parts = [torch.zeros_like(value) for _ in range(world)]
        torch.distributed.all_gather(parts, value)
        gathered[name] = torch.cat(parts).cpu()
    metrics = train_once(engine, local, micro_batch_size=2)
    weights = full_weights(engine)
    if rank == 0:
        torch.save({**gathered, "metrics": metrics, "weights": weights}, os.path.join(out_dir, "result.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
