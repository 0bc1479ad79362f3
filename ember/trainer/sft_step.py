"""Supervised fine-tuning on the shared TrainEngine: SFT examples become a Batch whose
"prompt" is the first token and whose "response" is the rest, with the loss mask as the
response mask, so the engine's log-prob path, micro-batching and loss scaling serve SFT
unchanged. The loss is the token-mean negative log-likelihood over the mini-batch, the
loss `model(input_ids, labels=...)` of Hugging Face computes on the same batch."""

from __future__ import annotations

import torch

from ember.data.batch import Batch
from ember.data.sft_dataset import SFTExample
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput, TrainEngine

EVAL_EXAMPLES_PER_TOKEN_BUDGET_FORWARD = 256
"""With a token budget, validation examples handed to one `forward` (it plans their micro-batches)."""
EVAL_MICRO_BATCHES_PER_FORWARD = 8  # evaluation pads this many micro-batches together per forward call


def sft_batch(examples: list[SFTExample], pad_token_id: int) -> Batch:
    """Right-padded sequences; position 0 is the one-token prompt, every later token a target
    where its loss mask is 1."""
    length = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for row, example in enumerate(examples):
        size = len(example.input_ids)
        input_ids[row, :size] = torch.tensor(example.input_ids)
        attention_mask[row, :size] = 1
        loss_mask[row, :size] = torch.tensor(example.loss_mask)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 response_mask=loss_mask[:, 1:] * attention_mask[:, 1:])


def sft_loss(output: ModelOutput, batch: Batch, context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch's token-mean negative log-likelihood."""
    mask = batch.response_mask.to(output.log_probs.dtype)
    loss = -(output.log_probs * mask).sum() / max(context.num_tokens, 1)
    return loss, {}


def sft_update(engine: TrainEngine, examples: list[SFTExample], pad_token_id: int,
               micro_batch_size: int | MicroBatchSpec) -> dict[str, float]:
    """One optimizer step; metrics `loss` (mean NLL per target token), `grad_norm`, `lr`."""
    return engine.train_mini_batch(sft_batch(examples, pad_token_id), sft_loss, micro_batch_size)


def sft_eval_sums(engine: TrainEngine, examples: list[SFTExample], pad_token_id: int,
                  micro_batch_size: int | MicroBatchSpec) -> tuple[float, int]:
    """(summed NLL, target tokens) over `examples`, without gradients; the mean NLL per target
    token is their ratio, and sums from several ranks add up to the whole set's."""
    total, tokens = 0.0, 0
    spec = MicroBatchSpec.of(micro_batch_size)
    chunk = spec.size * EVAL_MICRO_BATCHES_PER_FORWARD if spec.size else EVAL_EXAMPLES_PER_TOKEN_BUDGET_FORWARD
    for start in range(0, len(examples), chunk):
        batch = sft_batch(examples[start:start + chunk], pad_token_id)
        log_probs = engine.forward(batch, micro_batch_size).log_probs
        mask = batch.response_mask.to(log_probs.device, log_probs.dtype)
        total -= (log_probs * mask).sum().item()
        tokens += int(mask.sum().item())
    return total, tokens
