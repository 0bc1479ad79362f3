"""`ember nla sft`: NLA's supervised fine-tuning, of the actor or of the critic, from one SFT parquet.

`nla.train_mode=actor`: cross-entropy on the response (its EOS included) after the fork's SFT
prompt, with the row's vector injected at the marker (`nla.injection.mode`) in every forward.
`nla.train_mode=critic`: the reconstructor (`nla.critic.model_path`, else `model.partial_pretrain`,
cut after `nla.critic.truncate_layers` when set) reads the response alone and learns the vector
at `nla.critic.output_layer_index` by plain MSE, at `nla.critic_lr` for `nla.critic_epochs`
when set. Both are `ember sft`'s loop (checkpoints, resume, validation every `test_freq`,
the TensorBoard log and the curves) and both end in an HF folder (`default_local_dir/hf_model`)
that `ember nla train` takes as `actor_rollout_ref.model.path` or `critic.model.path`.
Validation reports the actor's NLL per response token, or the critic's MSE, as `val/loss`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from ember.config.schema.nla_sft import NLASFTConfig
from ember.data.batch import Batch
from ember.data.sft_dataset import SFTExample
from ember.distributed.device import init_distributed, shutdown_distributed, world_size
from ember.engines.base import MicroBatchSpec
from ember.nla.data import NLASFTDataset, NLASFTExample, reading_options
from ember.trainer.rank_setup import build_engine, use_configured_device
from ember.trainer.sft import SFTTrainer, check_sft_config, sft_optim_options
from ember.trainer.sft_step import (EVAL_EXAMPLES_PER_TOKEN_BUDGET_FORWARD, EVAL_MICRO_BATCHES_PER_FORWARD, sft_batch,
                                    sft_loss)
from ember.workers.reconstructor import mse_loss, reconstruction_batch, squared_errors

logger = logging.getLogger("ember.nla")


PADDING_INDEX = -1
"""`NLASFTExample.index` of a copy that only evens out the ranks' validation work (it counts for nothing)."""


def counts(example: NLASFTExample) -> bool:
    return example.index != PADDING_INDEX


def nla_sft_batch(examples: list[NLASFTExample], pad_token_id: int) -> Batch:
    """The actor's SFT batch (`sft_step.sft_batch`: the loss on the response) with each vector at its marker;
    padding copies carry no loss."""
    batch = sft_batch([SFTExample(e.prompt_ids + e.response_ids,
                                  [0] * len(e.prompt_ids) + [int(counts(e))] * len(e.response_ids))
                       for e in examples], pad_token_id)
    return batch.with_fields(activation_vectors=torch.stack([example.vector for example in examples]),
                             injection_positions=torch.tensor([example.marker_position for example in examples]))


def critic_sft_batch(examples: list[NLASFTExample], pad_token_id: int) -> tuple[Batch, torch.Tensor]:
    """The reconstructor's batch of the responses alone, and a [B] weight (0 for padding copies)."""
    batch = reconstruction_batch([], [example.response_ids for example in examples],
                                 torch.stack([example.vector for example in examples]), pad_token_id)
    return batch, torch.tensor([float(counts(example)) for example in examples])


class NLASFTTrainer(SFTTrainer):
    """`ember sft`'s loop on NLA's SFT rows, for the actor or the critic (see the module docstring)."""

    def __init__(self, cfg: NLASFTConfig):
        self.trains_critic = cfg.nla.train_mode == "critic"
        super().__init__(cfg)

    @property
    def total_epochs(self) -> int:
        epochs = self.cfg.nla.critic_epochs if self.trains_critic else None
        return epochs or self.cfg.trainer.total_epochs

    @functools.cached_property
    def reading(self):
        """(marker, vector options) of the train and validation files alike."""
        return reading_options(self.cfg.nla, self.tokenizer, self.cfg.model.partial_pretrain,
                               self.cfg.model.trust_remote_code)

    def build_dataset(self, files, max_samples: int = -1) -> NLASFTDataset:
        cfg = self.cfg
        return NLASFTDataset(files, self.tokenizer, *self.reading, prompt_key=cfg.data.prompt_key,
                             response_key=cfg.data.response_key, max_length=cfg.data.max_length,
                             truncation=cfg.data.truncation, max_samples=max_samples)

    def build_engine(self):
        cfg = self.cfg
        if not self.trains_critic:
            optim = sft_optim_options(cfg.optim, self.total_steps)
            return build_engine(cfg.model.partial_pretrain, "actor", cfg.model, cfg.model.fsdp_config, optim,
                                seed=cfg.trainer.seed, use_remove_padding=cfg.use_remove_padding,
                                use_liger=cfg.model.use_liger, injection_mode=cfg.nla.injection.mode)
        critic = cfg.nla.critic
        lr = cfg.nla.critic_lr if cfg.nla.critic_lr is not None else cfg.optim.lr
        optim = sft_optim_options(dataclasses.replace(cfg.optim, lr=lr), self.total_steps)
        keep = critic.truncate_layers if critic.truncate_layers and critic.truncate_layers > 0 else None  # <= 0: all
        return build_engine(critic.model_path or cfg.model.partial_pretrain, "reconstructor", cfg.model,
                            cfg.model.fsdp_config, optim, seed=cfg.trainer.seed,
                            use_remove_padding=cfg.use_remove_padding, output_layer_index=critic.output_layer_index,
                            truncate_at_layer=keep)

    def update(self, examples: list[NLASFTExample]) -> dict[str, float]:
        pad = self.tokenizer.pad_token_id
        if self.trains_critic:
            batch, _ = critic_sft_batch(examples, pad)
            return self.engine.train_mini_batch(batch, mse_loss, self.micro_batches)
        return self.engine.train_mini_batch(nla_sft_batch(examples, pad), sft_loss, self.micro_batches)

    def eval_sums(self, examples: list[NLASFTExample]) -> tuple[float, int]:
        """The critic's summed MSE over its examples, or the actor's summed NLL over response tokens."""
        pad = self.tokenizer.pad_token_id
        spec = MicroBatchSpec.of(self.micro_batches)
        chunk = spec.size * EVAL_MICRO_BATCHES_PER_FORWARD if spec.size else EVAL_EXAMPLES_PER_TOKEN_BUDGET_FORWARD
        total, count = 0.0, 0
        for start in range(0, len(examples), chunk):
            part = examples[start:start + chunk]
            if self.trains_critic:
                batch, weights = critic_sft_batch(part, pad)
                predictions = self.engine.forward(batch, self.micro_batches).predictions
                total += float((squared_errors(predictions, batch.activation_vectors) * weights).sum())
                count += int(weights.sum())
            else:
                batch = nla_sft_batch(part, pad)
                log_probs = self.engine.forward(batch, self.micro_batches).log_probs
                mask = batch.response_mask.to(log_probs.dtype)
                total -= float((log_probs * mask).sum())
                count += int(mask.sum())
        return total, count

    @property
    def hf_in_checkpoints(self) -> bool:
        """`trainer.checkpoint.save_contents` holds hf_model (the fork's SFT files list it)."""
        return "hf_model" in self.cfg.trainer.checkpoint.save_contents

    def save(self) -> bool:
        """As `ember sft`, unless `trainer.disable_checkpointing` (the fork's switch): then no checkpoint at all
        (the final HF folder is still written)."""
        if self.cfg.trainer.disable_checkpointing:
            return False
        return super().save()

    @staticmethod
    def example_tokens(example: NLASFTExample) -> int:
        return len(example.prompt_ids) + len(example.response_ids)

    def pad_for_ranks(self, examples: list[NLASFTExample]) -> list[NLASFTExample]:
        padding = dataclasses.replace(examples[0], index=PADDING_INDEX)
        return examples + [padding] * (-len(examples) % self.dp_size)


def run_nla_sft(cfg: NLASFTConfig) -> int:
    """`ember nla sft`: fine-tunes the actor or the critic (nla.train_mode) to the end of the run."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_configured_device(cfg.trainer.device)
    init_distributed()
    check_sft_config(cfg)
    trainer = NLASFTTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    if world_size() > 1:
        shutdown_distributed()
    return 0
