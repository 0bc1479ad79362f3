"""`ember sft`: supervised fine-tuning, readable top to bottom.

Each step takes `data.train_batch_size` examples in the seeded order of the epoch; every
rank walks the same order and trains on its contiguous 1/dp block of them, so the gradient
is the one a single process gets on the whole batch (the engine normalises the token-mean
loss by global token counts). Validation loss every `trainer.test_freq` steps and at the
end, checkpoints (engine, loader position, RNG) every `trainer.save_freq` steps and at the
end, then a Hugging Face export to `default_local_dir/hf_model` and `curves.png` (with LoRA,
`model.lora_rank` > 0: only the adapter trains and is checkpointed; `hf_model` is the merged model and
`lora_adapter` PEFT's adapter folder).

Several processes: `torchrun --nproc_per_node=N -m ember.trainer.sft key=value ...`. The
launch decides the world size: torchrun's process counts fill `trainer.nnodes` and
`trainer.n_gpus_per_node` (overriding a config file's values, as verl ignores them there).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ember.config import ConfigError, config_to_yaml
from ember.config.parallel import world_size as configured_world_size
from ember.config.schema import SFTConfig
from ember.config.schema.sft import SFTOptimConfig
from ember.config.validate import sft_accumulation_note
from ember.data.prompt_loader import PromptLoader
from ember.data.sft_dataset import SFTDataset, SFTExample
from ember.distributed.device import current_device, init_distributed, rank, shutdown_distributed, world_size
from ember.engines.base import MicroBatchSpec
from ember.engines.optim import OptimOptions
from ember.trainer.checkpoint import HF_CHECKPOINT_DIR, CheckpointManager
from ember.trainer.command_line import (OVERRIDE_HELP, RunPlan, add_config_arguments, config_overrides, exit_status,
                                        run_configured)
from ember.trainer.experiment_trackers import TrackedRun, check_tracker_login
from ember.trainer.faults import BadStepGuard, BadStepsError, StopRequest
from ember.trainer.loggers import MetricLogger
from ember.trainer.lora_setup import check_lora_model, lora_options
from ember.trainer.plot import plot_curves
from ember.trainer.resume import CheckpointedModel, resume_from_checkpoint
from ember.trainer.run_folder import check_run_folder, claim_run_folder
from ember.trainer.rank_setup import build_engine, megatron_section, use_configured_device
from ember.trainer.model_folder import check_model_path, check_tokenizer, model_vocab_size
from ember.trainer.rl_setup import (check_data_files, check_megatron_sizes, check_output_dir,
                                     tensorboard_environment_dir)
from ember.trainer.run_state import save_run_state
from ember.trainer.sft_step import sft_eval_sums, sft_update

logger = logging.getLogger("ember.sft")

ENGINE_DIR = "actor"  # the engine's folder inside global_step_N, named as `ember train` names the policy's
RUN_STATE_KEYS = ("step", "loader")
LORA_ADAPTER_DIR = "lora_adapter"  # with LoRA, PEFT's adapter folder beside hf_model (the merged model)  # what `save` writes to trainer_state.json


class SFTTrainer:
    """One SFT run: the loop, validation, checkpoints and the final export."""

    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        self.run_dir = cfg.trainer.default_local_dir
        self.tokenizer = load_tokenizer(cfg)
        self.train_loader = PromptLoader(self.build_dataset(cfg.data.train_files, cfg.data.train_max_samples),
                                         cfg.data.train_batch_size, shuffle=True, seed=cfg.trainer.seed)
        self.val_dataset = (self.build_dataset(cfg.data.val_files, cfg.data.val_max_samples)
                            if cfg.data.val_files else None)
        self.total_steps = cfg.trainer.total_training_steps or len(self.train_loader) * self.total_epochs
        note = sft_accumulation_note(cfg)
        if note:
            logger.warning(note)
        self.engine = self.build_engine()
        self.rank = rank()
        # Batches split over data-parallel ranks: all ranks with FSDP2; the ranks of one tensor/pipeline
        # group share a share with Megatron.
        self.dp_rank, self.dp_size = self.engine.dp_rank, self.engine.dp_size
        self.step = 0
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.max_ckpt_to_keep, is_writer=self.rank == 0,
                                             copy_to=cfg.trainer.default_hdfs_dir)
        self.logger = MetricLogger(self.run_dir, cfg.trainer.logger, self.total_steps, enabled=self.rank == 0,
                                   tracked_run=TrackedRun.of(cfg))
        self.guard = BadStepGuard(cfg.trainer.max_loss_or_grad_norm)

    # --- what a variant (NLA's SFT) builds otherwise ------------------------------------------------

    @property
    def total_epochs(self) -> int:
        return self.cfg.trainer.total_epochs

    def build_dataset(self, files, max_samples: int = -1):
        return build_dataset(files, self.tokenizer, self.cfg, max_samples)

    def build_engine(self):
        cfg = self.cfg
        return build_engine(cfg.model.partial_pretrain, "actor", cfg.model, cfg.model.fsdp_config,
                            sft_optim_options(cfg.optim, self.total_steps), seed=cfg.trainer.seed,
                            use_remove_padding=cfg.use_remove_padding, use_liger=cfg.model.use_liger,
                            megatron=megatron_section(cfg.model), lora=lora_options(cfg.model, "model"))

    def update(self, examples: list) -> dict[str, float]:
        """One optimizer step on this rank's share of the examples."""
        return sft_update(self.engine, examples, self.tokenizer.pad_token_id, self.micro_batches)

    def eval_sums(self, examples: list) -> tuple[float, int]:
        """(summed loss, counted items) of this rank's share of the validation examples."""
        return sft_eval_sums(self.engine, examples, self.tokenizer.pad_token_id, self.micro_batches)

    @staticmethod
    def example_tokens(example) -> int:
        return len(example.input_ids)

    @property
    def hf_in_checkpoints(self) -> bool:
        """Whether every checkpoint also holds a transformers folder (`<engine dir>/huggingface`)."""
        return False

    def pad_for_ranks(self, examples: list) -> list:
        """`examples` padded to a multiple of the data-parallel size with examples that count for nothing."""
        return pad_to_multiple(examples, self.dp_size)

    # --- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to `total_steps` (or a requested stop, after which a checkpoint is written)."""
        trainer = self.cfg.trainer
        self.resume()
        with StopRequest() as stop:
            while self.step < self.total_steps:
                for examples in self.train_loader:
                    self.step += 1
                    metrics = self.train_step(examples)
                    last = self.step >= self.total_steps
                    if self.val_dataset is not None and (last or _every(trainer.test_freq, self.step)):
                        metrics["val/loss"] = self.validation_loss()
                    self.logger.log(self.step, metrics)
                    if self.guard.should_stop:
                        raise BadStepsError(f"{self.guard.stop_message()}. Lower optim.lr or check the data.")
                    stopping = stop.on_any_rank()  # every rank stops at the same step, whichever got the signal
                    checkpoint_due = last or _every(trainer.save_freq, self.step) or stopping
                    saved = self.save() if checkpoint_due else False
                    if stopping and not last:  # a stop on the last step finishes the run
                        logger.warning("stopping at step %d on %s; %s, resume with trainer.resume_mode=auto", self.step,
                                       stop.signal_name or "another rank's stop signal",
                                       "checkpoint saved" if saved else "no checkpoint saved")
                        return
                    if last:
                        break
        self.finish()

    @property
    def micro_batches(self) -> int | MicroBatchSpec:
        """Examples per micro-batch, or a token budget with data.use_dynamic_bsz."""
        data = self.cfg.data
        return (MicroBatchSpec(max_token_len=data.max_token_len_per_gpu) if data.use_dynamic_bsz
                else data.micro_batch_size_per_gpu)

    def train_step(self, examples: list[SFTExample]) -> dict[str, float]:
        """One optimizer step on this rank's block of the global batch `examples`."""
        start = time.perf_counter()
        update = self.update(rank_share(examples, self.dp_rank, self.dp_size))
        seconds = time.perf_counter() - start
        self.guard.record(self.step, update["skipped"] > 0,
                          {"train/loss": update["loss"], "train/grad_norm": update["grad_norm"]})
        tokens = sum(self.example_tokens(example) for example in examples)
        return {"train/loss": update["loss"], "train/lr": update["lr"], "train/grad_norm": update["grad_norm"],
                "train/tokens_per_s": tokens / seconds, "train/epoch": self.step / len(self.train_loader)}

    def validation_loss(self) -> float:
        """Mean NLL per target token over the whole validation set, all ranks together."""
        examples = self.pad_for_ranks([self.val_dataset[i] for i in range(len(self.val_dataset))])
        nll, tokens = self.eval_sums(rank_share(examples, self.dp_rank, self.dp_size))
        summed = torch.tensor([nll, tokens], dtype=torch.float64, device=current_device())
        dist.all_reduce(summed)
        nll, tokens = summed.tolist()
        return nll / max(tokens, 1.0)

    # --- checkpoints and the end ------------------------------------------------------------------

    def save(self) -> bool:
        """Writes the checkpoint of this step unless its weights are unsound (see BadStepGuard); True if written."""
        if not self.guard.weights_sound:
            logger.warning(self.guard.unsound_save_message(self.step))
            return False

        def write(directory: str) -> None:
            self.engine.save(os.path.join(directory, ENGINE_DIR))
            if self.hf_in_checkpoints:
                self.engine.export_hf(os.path.join(directory, ENGINE_DIR, HF_CHECKPOINT_DIR), tokenizer=self.tokenizer)
            if self.rank == 0:
                save_run_state(directory, step=self.step, loader=self.train_loader.state_dict())

        self.guard.last_sound_checkpoint = self.checkpoints.save(self.step, write, barrier=dist.barrier)
        return True

    def resume(self) -> None:
        """Continue from the checkpoint `trainer.resume_mode` picks, if any (see resume.py); only then take the
        run directory (run_folder.py) and write the resolved config there, and start the metric log."""
        trainer = self.cfg.trainer
        resumed = resume_from_checkpoint(self.checkpoints, trainer.resume_mode, trainer.resume_from_path,
                                         [(ENGINE_DIR, self.engine)], RUN_STATE_KEYS)
        claim_run_folder(self.checkpoints, resumed.path if resumed else None, trainer.overwrite_default_local_dir,
                         config_to_yaml(self.cfg))
        if resumed is None:
            self.logger.start(None)
            return
        self.step = resumed.values["step"]
        self.train_loader.load_state_dict(resumed.values["loader"])
        self.guard.last_sound_checkpoint = resumed.path
        self.logger.start(self.step)
        logger.warning("resumed from %s at step %d", resumed.path, self.step)

    def finish(self) -> None:
        """The trained model as a Hugging Face directory (with LoRA: merged, and the adapter as PEFT's folder
        `lora_adapter` beside it), and the loss curves as a PNG; nothing but a warning naming the last sound
        checkpoint when the weights are unsound (`BadStepGuard`)."""
        export_dir = os.path.join(self.run_dir, "hf_model")
        if not self.guard.weights_sound:  # diverged in the last steps: no final model of those weights
            if self.rank == 0:
                logger.warning(self.guard.unsound_export_message(export_dir))
            return
        self.engine.export_hf(export_dir, tokenizer=self.tokenizer)
        if self.cfg.model.lora_rank:
            adapter_dir = os.path.join(self.run_dir, LORA_ADAPTER_DIR)
            self.engine.export_lora_adapter(adapter_dir)
            if self.rank == 0:
                print(f"LoRA adapter (PEFT format): {adapter_dir}", flush=True)
        if self.rank != 0:
            return
        plot_path = plot_curves(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.run_dir, "curves.png"),
                                ["train/loss", "val/loss"], "SFT loss")
        print(f"final model (Hugging Face format): {export_dir}\ncurves: {plot_path}", flush=True)


# --- building the parts -------------------------------------------------------------------------


def load_tokenizer(cfg: SFTConfig) -> PreTrainedTokenizerBase:
    """`model.tokenizer_path` (or the model's own), padding with EOS where it has no pad token."""
    model = cfg.model
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or model.partial_pretrain,
                                              trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token_id is None:  # e.g. Llama tokenizers
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.data.chat_template is not None:
        tokenizer.chat_template = cfg.data.chat_template
    return tokenizer


def build_dataset(files, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig, max_samples: int = -1) -> SFTDataset:
    """Messages form with `data.multiturn.enable`; otherwise prompt/response columns, or
    pre-tokenised `input_ids`/`labels` when the files have those instead."""
    data = cfg.data
    form = "messages" if data.multiturn.enable else "auto"
    return SFTDataset(files, tokenizer, max_length=data.max_length, truncation=data.truncation, form=form,
                      messages_key=data.multiturn.messages_key, tools_key=data.multiturn.tools_key,
                      prompt_key=data.prompt_key,
                      response_key=data.response_key, max_samples=max_samples)


def sft_optim_options(optim: SFTOptimConfig, total_steps: int) -> OptimOptions:
    """AdamW with linear warmup over `warmup_steps_ratio` of the run, then constant or cosine to 0."""
    return OptimOptions(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                        clip_grad=optim.clip_grad, lr_warmup_steps_ratio=optim.warmup_steps_ratio,
                        lr_scheduler_type=optim.lr_scheduler, total_training_steps=total_steps)


def rank_share(examples: list[SFTExample], rank_index: int, dp_size: int) -> list[SFTExample]:
    """Rank `rank_index`'s contiguous block of `examples`, whose length dp_size divides."""
    share = len(examples) // dp_size
    return examples[rank_index * share:(rank_index + 1) * share]


def pad_to_multiple(examples: list[SFTExample], multiple: int) -> list[SFTExample]:
    """`examples` plus copies with no loss target, up to a multiple of `multiple`, so that
    every rank evaluates as many sequences (and runs as many forwards) as the others."""
    missing = -len(examples) % multiple
    return examples + [SFTExample(examples[0].input_ids, [0] * len(examples[0].input_ids))] * missing


def _every(frequency: int, step: int) -> bool:
    return frequency > 0 and step % frequency == 0


def sft_checkpointed_models(cfg: SFTConfig) -> list[CheckpointedModel]:
    """The model a checkpoint of this run holds, as a resume checks it: the fine-tuned causal LM (an NLA
    reconstructor, `nla.train_mode=critic`, is built otherwise and not checked)."""
    nla = getattr(cfg, "nla", None)
    if nla is not None and nla.train_mode == "critic":
        return []
    model = cfg.model
    return [CheckpointedModel(ENGINE_DIR, "model.partial_pretrain", model.partial_pretrain,
                              trust_remote_code=model.trust_remote_code, lora=lora_options(model, "model"))]


def check_sft_config(cfg: SFTConfig) -> None:
    """What only a real run needs: a model folder, data files that exist, an output folder that can be
    written without losing another run's work (`run_folder.check_run_folder`), and as many processes as the
    config names (the RL run's checks, `rl_setup.check_input_paths`)."""
    if cfg.model.partial_pretrain is None:
        raise ConfigError("model.partial_pretrain is not set; point it at a Hugging Face model directory or hub id "
                          "to fine-tune (the built-in demo is `ember train` with no arguments)")
    model = cfg.model
    check_model_path("model.partial_pretrain", model.partial_pretrain, trust_remote_code=model.trust_remote_code)
    if model.tokenizer_path is not None:
        check_model_path("model.tokenizer_path", model.tokenizer_path, tokenizer_only=True)
    check_tokenizer("model.tokenizer_path" if model.tokenizer_path else "model.partial_pretrain",
                    model.tokenizer_path or model.partial_pretrain,
                    model_vocab_size(model.partial_pretrain, model.trust_remote_code), "model.partial_pretrain",
                    model.trust_remote_code)
    check_lora_model(lora_options(model, "model"), model.partial_pretrain, model.trust_remote_code)
    if cfg.model.strategy == "megatron":
        check_megatron_sizes("model.megatron", cfg.model.partial_pretrain, cfg.model.megatron, cfg.model.trust_remote_code)
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is not set; give parquet file(s) of training examples")
    check_data_files("data.train_files", cfg.data.train_files)
    check_data_files("data.val_files", cfg.data.val_files)
    outputs = {"trainer.default_local_dir": cfg.trainer.default_local_dir,
               "trainer.default_hdfs_dir": cfg.trainer.default_hdfs_dir,
               **tensorboard_environment_dir(cfg.trainer.logger)}
    for key, path in outputs.items():
        if path:
            check_output_dir(key, path)
    check_tracker_login(cfg.trainer.logger)
    check_run_folder(cfg.trainer, sft_checkpointed_models(cfg))
    configured = configured_world_size(cfg.trainer)
    if world_size() != configured:
        raise ConfigError(f"trainer.nnodes × trainer.n_gpus_per_node = {configured} but this run has {world_size()} "
                          f"process(es); launch several with `torchrun --nproc_per_node={configured} -m "
                          "ember.trainer.sft ...`, which sets both from its own counts")


def run_sft(cfg: SFTConfig) -> int:
    """`ember sft`: fine-tunes the configured model to the end of the run (or a requested stop)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_configured_device(cfg.trainer.device)
    init_distributed()
    check_sft_config(cfg)
    if cfg.model.external_lib:
        importlib.import_module(cfg.model.external_lib)
    trainer = SFTTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    if world_size() > 1:  # one-rank groups of library callers (tests, notebooks) stay for their next engine
        shutdown_distributed()
    return 0


def launched_world_overrides() -> list[str]:
    """`trainer.nnodes` and `trainer.n_gpus_per_node` as torchrun launched this process; none without torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return []
    total, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return [f"trainer.nnodes={total // per_node}", f"trainer.n_gpus_per_node={per_node}"]


def main(argv: list[str] | None = None) -> int:
    """`[torchrun ...] python -m ember.trainer.sft [--config-path DIR --config-name NAME] key=value ...`,
    parsed as `ember sft` parses them, with torchrun's counts as trainer.nnodes and trainer.n_gpus_per_node
    (a command-line value that contradicts them stops the run with an error)."""
    parser = argparse.ArgumentParser(prog="python -m ember.trainer.sft", allow_abbrev=False, epilog=OVERRIDE_HELP,
                                     description="supervised fine-tuning (as `ember sft`), one process per GPU under torchrun",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    overrides = [*launched_world_overrides(), *config_overrides(parser, args, extra)]
    return exit_status(lambda: run_configured(args, overrides, SFTConfig, lambda cfg: RunPlan(run_sft)))


if __name__ == "__main__":
    sys.exit(main())
