"""The built-in demo's supervised warm start: a model built from scratch learns the answer
format of its task until it solves a set share of training problems, and no further.

The warm start stops on accuracy, not on a step count, because a small model learns this
task in a sudden jump whose step varies from seed to seed: a fixed step count leaves it
anywhere from 10% to 90%, so RL would either have nothing to start from or nothing left to
do. Accuracy is checked with one forward pass: a reply comes out of greedy decoding exactly
when every one of its tokens is the model's top choice after the tokens before it, so the
share of probe problems whose reference reply is the argmax at every position is their
greedy accuracy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from ember.data.batch import Batch
from ember.data.prompt_loader import PromptLoader
from ember.data.sft_dataset import SFTDataset
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.trainer.loggers import format_duration
from ember.trainer.sft_step import sft_batch, sft_update


@dataclass(frozen=True)
class WarmStartOptions:
    """How long and how hard the warm start trains."""

    target_accuracy: float  # stop once greedy decoding solves this share of the probe problems
    max_steps: int  # stop here even if the target is not reached
    batch_size: int  # conversations per optimizer step
    lr: float  # after `warmup_steps` of linear warm-up, constant
    warmup_steps: int
    check_every: int  # steps between accuracy checks (each one prints a progress line)
    probe_size: int  # training conversations the accuracy is measured on
    max_length: int  # tokens per conversation


def greedy_accuracy(model: torch.nn.Module, batch: Batch) -> float:
    """The share of `batch`'s rows (an `sft_batch`) whose target tokens are all the model's top
    choice given the reference tokens before them: the rows greedy decoding would reproduce."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    predicted = logits[:, :-1].argmax(dim=-1)
    right = (predicted == batch.input_ids[:, 1:]) | (batch.response_mask == 0)
    return right.all(dim=-1).float().mean().item()


def warm_start(model_dir: str, out_dir: str, sft_file: str, seed: int, options: WarmStartOptions) -> float:
    """Trains the model in `model_dir` on the conversations of `sft_file` until it reaches
    `options.target_accuracy` (or `max_steps`), exports it to `out_dir`, returns its accuracy."""
    engine = FSDPEngine(EngineOptions(
        model_path=model_dir, role="actor", model_dtype="float32", param_dtype="float32", seed=seed,
        optim=OptimOptions(lr=options.lr, weight_decay=0.0, lr_warmup_steps=options.warmup_steps,
                           lr_scheduler_type="constant", total_training_steps=options.max_steps)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = SFTDataset(sft_file, tokenizer, max_length=options.max_length)
    probe = sft_batch([dataset[index] for index in range(options.probe_size)], tokenizer.pad_token_id).to(engine.device)
    loader = PromptLoader(dataset, options.batch_size, shuffle=True, seed=seed)
    start, step = time.monotonic(), 0
    while True:  # epochs, until a check ends the warm start
        for examples in loader:
            step += 1
            metrics = sft_update(engine, examples, tokenizer.pad_token_id, micro_batch_size=options.batch_size)
            if step % options.check_every == 0 or step == options.max_steps:
                accuracy = greedy_accuracy(engine.module(), probe)
                print(f"warm start step {step} | loss {metrics['loss']:.3f} | solves {accuracy:.0%} of "
                      f"{options.probe_size} training problems (stops at {options.target_accuracy:.0%}) | "
                      f"elapsed {format_duration(time.monotonic() - start)}", flush=True)
                if accuracy >= options.target_accuracy or step == options.max_steps:
                    engine.export_hf(out_dir, tokenizer=tokenizer)
                    return accuracy
