"""`ember export CKPT OUT`: a checkpoint of `ember train` or `ember sft` as a Hugging Face model directory.

Both commands write the trained policy to `<run_dir>/global_step_N/actor/`: sharded weights
and optimizer state, not a model definition. The architecture comes from the run's resolved
configuration (`<run_dir>/config.yaml`, written when the run starts), whose base model
(`actor_rollout_ref.model.path` for RL, `model.partial_pretrain` for SFT) must still exist;
which of the two commands wrote the run is read from that file's sections. The weights are
loaded into a forward-only engine built as the run built its own and written with the run's
tokenizer, ready for `AutoModelForCausalLM.from_pretrained`. A LoRA run's checkpoint holds the
adapter alone: it is written as PEFT's adapter folder (`adapter_config.json`,
`adapter_model.safetensors`) for `PeftModel.from_pretrained(base, folder)`, or with `merged=True`
(`ember export --merged`) as the base model with the adapter merged in. A checkpoint with a missing or
damaged file is refused with an error that names the file (`resume.py` checks and loads it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from ember.config import ConfigError, EmberConfig, SFTConfig, load_config
from ember.config.yaml_io import read_yaml_file
from ember.errors import UserError
from ember.engines.lora import LoraOptions
from ember.trainer.checkpoint import CheckpointError, CheckpointProblem
from ember.trainer.lora_setup import lora_options
from ember.trainer.resume import check_engine_files, load_engines
from ember.trainer.rank_setup import build_engine, megatron_section
from ember.trainer.rank_setup import load_tokenizer as load_rl_tokenizer
from ember.trainer.rl_setup import check_model_path
from ember.trainer.sft import ENGINE_DIR
from ember.trainer.sft import load_tokenizer as load_sft_tokenizer

RUN_CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class PolicySource:
    """What rebuilding a run's policy takes, read from the run's configuration."""

    model_path: str  # the base model the run started from (its architecture)
    model_cfg: Any  # the run's model section (dtype, attention implementation)
    fsdp_config: Any
    tokenizer: PreTrainedTokenizerBase
    seed: int
    megatron: Any = None
    """The policy's `megatron` section when it trained with strategy megatron, else None."""
    lora: LoraOptions | None = None
    """The policy's LoRA adapters when it trained with them, else None."""


def export_checkpoint(checkpoint_dir: str, out_dir: str, merged: bool = False) -> str:
    """Writes the policy of `checkpoint_dir` (a `global_step_N` folder) to `out_dir` (a LoRA run's: its adapter
    folder, or with `merged` the merged model), says where on one line, and returns `out_dir`."""
    checkpoint_dir = os.path.normpath(checkpoint_dir)
    policy_dir = os.path.join(checkpoint_dir, ENGINE_DIR)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # transformers would log it and write nothing
        raise UserError(f"{out_dir} is a file, not a folder; pass the folder to write the Hugging Face model to "
                        "(created if missing)")
    if not os.path.exists(checkpoint_dir):
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass a global_step_N folder written by "
                        "ember train or ember sft")
    if not os.path.isdir(policy_dir):
        raise UserError(f"{checkpoint_dir} is not a checkpoint: it has no {ENGINE_DIR}/ folder; pass a global_step_N "
                        "folder written by ember train or ember sft")
    source = read_policy_source(os.path.dirname(checkpoint_dir))
    # "ref": weights only; the optimizer state in the checkpoint is not needed to export, nor the
    # run's CPU offload policy (refused on a machine without an accelerator, useless for one forward).
    fsdp_config = replace(source.fsdp_config, offload_policy=False)
    if merged and source.lora is None:
        raise UserError(f"--merged merges a LoRA adapter, but the run of {checkpoint_dir} trained all weights "
                        "(lora_rank=0); export without --merged")
    engine = build_engine(source.model_path, "ref", source.model_cfg, fsdp_config, None, seed=source.seed,
                          megatron=source.megatron, lora=source.lora)
    try:
        check_engine_files(checkpoint_dir, [(ENGINE_DIR, engine)])
        load_engines(checkpoint_dir, [(ENGINE_DIR, engine)])
    except CheckpointProblem as problem:
        raise CheckpointError(f"checkpoint {checkpoint_dir} cannot be exported: {problem}. Export another "
                              "global_step_N folder of the run") from None
    if source.lora is not None and not merged:
        engine.export_lora_adapter(out_dir)
        print(f"{checkpoint_dir} exported (PEFT adapter of {source.model_path}): {out_dir}", flush=True)
        return out_dir
    engine.export_hf(out_dir, tokenizer=source.tokenizer)
    print(f"{checkpoint_dir} exported (Hugging Face format{', LoRA merged' if merged else ''}): {out_dir}", flush=True)
    return out_dir


def read_policy_source(run_dir: str) -> PolicySource:
    """The policy's base model, settings and tokenizer from `run_dir/config.yaml` of an RL or SFT run."""
    path = os.path.join(run_dir, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir} has no {RUN_CONFIG_FILE}; the checkpoint must stay inside the run folder "
                          "that ember train or ember sft wrote (it holds the run's configuration)")
    sections = read_yaml_file(path)
    sections = sections if isinstance(sections, dict) else {}
    config_dir, config_name = run_dir, os.path.splitext(RUN_CONFIG_FILE)[0]
    if "actor_rollout_ref" in sections:
        cfg = load_config([], config_path=config_dir, config_name=config_name, schema=EmberConfig)
        model = cfg.actor_rollout_ref.model
        check_model_path(f"actor_rollout_ref.model.path (in {path})", model.path)
        actor = cfg.actor_rollout_ref.actor
        return PolicySource(model.path, model, actor.fsdp_config, load_rl_tokenizer(cfg), cfg.trainer.seed,
                            megatron_section(actor), lora_options(model, "actor_rollout_ref.model"))
    if "partial_pretrain" in (sections.get("model") or {}):
        cfg = load_config([], config_path=config_dir, config_name=config_name, schema=SFTConfig)
        check_model_path(f"model.partial_pretrain (in {path})", cfg.model.partial_pretrain)
        return PolicySource(cfg.model.partial_pretrain, cfg.model, cfg.model.fsdp_config, load_sft_tokenizer(cfg),
                            cfg.trainer.seed, megatron_section(cfg.model), lora_options(cfg.model, "model"))
    raise ConfigError(f"{path} is the configuration of neither an ember train run (no actor_rollout_ref section) "
                      "nor an ember sft run (no model.partial_pretrain); pass a global_step_N folder inside the run "
                      "folder of one of them")
