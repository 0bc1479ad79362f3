"""Tiny models, batches and losses for the FSDP engine tests, and the torchrun worker they launch.

Run as `python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp_engine_worker.py
MODEL_DIR OUT_DIR`: each rank takes its half of `make_batch()`, computes log-probs, makes one
update, saves a sharded checkpoint and exports a HF directory; rank 0 writes the gathered
log-probs, metrics and the full updated weights to OUT_DIR/result.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

from ember.data.batch import Batch
from ember.distributed.device import current_device, shutdown_distributed
from ember.engines.base import LossContext, ModelOutput
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.models.tiny import tiny_model_config


def make_model_dir(arch: str, out_dir: str, seed: int = 0) -> str:
    """Save a randomly initialised tiny fp32 model of `arch` (vocab 128) under out_dir; Qwen2's head is tied."""
    config = tiny_model_config(arch, vocab_size=128, tie_word_embeddings=arch == "qwen2")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def make_batch(seed: int = 0, samples: int = 4) -> Batch:
    """Samples with prompts and responses of different lengths (so padding and token counts differ)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        return torch.randint(3, 128, (length,), generator=generator).tolist()

    prompts = [tokens(3 + (2 * i) % 5) for i in range(samples)]
    responses = [tokens(2 + (3 * i) % 6) for i in range(samples)]
    return Batch.from_rollout(prompts, responses, pad_token_id=0, eos_token_ids=[1])


# AdamW's first update is lr·g/(|g|+eps): with eps ≫ |g| it is about lr·g, so comparing updated
# weights compares gradients (with eps=1e-8 it is lr·sign(g), which amplifies rounding noise).
GRADIENT_REVEALING_OPTIM = OptimOptions(lr=1.0, eps=1.0, weight_decay=0.0, clip_grad=1.0)


def engine_options(model_dir: str, **overrides) -> EngineOptions:
    """fp32 compute (exact comparisons on CPU) with a learning rate large enough to move a tiny model."""
    defaults = dict(param_dtype="float32", optim=OptimOptions(lr=1e-3, weight_decay=0.0, clip_grad=1.0))
    return EngineOptions(model_path=model_dir, **{**defaults, **overrides})


def mean_log_prob_loss(output: ModelOutput, batch: Batch,
                       context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the responses: this micro-batch's share."""
    token_sum = -(output.log_probs * batch.response_mask).sum()
    return token_sum / context.num_tokens, {"micro_tokens": float(batch.response_mask.sum())}


def full_weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """All full weights of an engine by HF name: CPU copies (sync tensors may alias live weights)."""
    return {name: tensor.detach().to("cpu", copy=True)
            for bucket in engine.named_parameters_for_sync() for name, tensor in bucket}


def main(model_dir: str, out_dir: str) -> None:
    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = make_batch()
    local = batch.split(len(batch) // world)[rank]
    log_probs = engine.forward(local, micro_batch_size=1).log_probs.to(current_device())
    gathered = [torch.zeros_like(log_probs) for _ in range(world)]
    torch.distributed.all_gather(gathered, log_probs)
    metrics = engine.train_mini_batch(local, mean_log_prob_loss, micro_batch_size=1)
    weights = full_weights(engine)
    engine.save(os.path.join(out_dir, "checkpoint"))
    engine.export_hf(os.path.join(out_dir, "hf"))
    if rank == 0:
        torch.save({"log_probs": torch.cat(gathered).cpu(), "metrics": metrics, "weights": weights},
                   os.path.join(out_dir, "result.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
