"""Sharded, resumable checkpoints of an FSDP2 engine, and export to a Hugging Face directory.

A checkpoint directory holds `model/` and `optim/` written by torch.distributed.checkpoint
(each rank writes its own shards; a checkpoint loads at any world size) and
`engine_state.json` with the learning-rate schedule's position. Every rank calls `save` and
`load`. `checkpoint_problem` checks a directory before a load without reading its shards
(`dcp_folder.py`: the metadata, read within `safe_pickle`'s allow-list, lists every shard with
the bytes it must hold, so a missing or cut-short shard shows from the file sizes); `load` reads
the metadata and the non-tensor entries (the optimizer's param_groups) through `safe_pickle` too,
so no pickle of a checkpoint that came from elsewhere runs code. `export_hf_model` gathers the
full weights on rank 0 and writes what `from_pretrained` reads; it is an output for users, not a
resume point.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ember.distributed.device import rank
from ember.engines.dcp_folder import dcp_folder_problem
from ember.engines.lora import is_adapter_name, merged_layers
from ember.engines.safe_pickle import RestrictedFileSystemReader, RestrictedLoadPlanner
from ember.models.loading import build_model_on_meta, resolve_dtype

ENGINE_STATE_FILE = "engine_state.json"


def save_checkpoint(path: str, model: nn.Module, optimizer: Optimizer | None, lr_scheduler: LRScheduler | None,
                    adapter_only: bool = False) -> None:
    """Write model shards, optimizer shards (if training) and the schedule's state under `path`; with
    `adapter_only`, of the model only its LoRA adapter's tensors (the optimizer holds nothing else)."""
    dcp.save(_model_state(model, adapter_only), checkpoint_id=os.path.join(path, "model"))
    if optimizer is not None:
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(path, "optim"))
    if rank() == 0:
        state = {"lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}
        with open(os.path.join(path, ENGINE_STATE_FILE), "w") as file:
            json.dump(state, file, indent=2)
    dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizer | None, lr_scheduler: LRScheduler | None,
                    adapter_only: bool = False) -> None:
    """Restore in place what `save_checkpoint` wrote under `path` (the same `adapter_only`)."""
    state_file = os.path.join(path, ENGINE_STATE_FILE)
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"{state_file} not found: {path!r} is not a checkpoint written by "
                                "the FSDP engine's save")
    model_state = _model_state(model, adapter_only)
    _load_dcp(model_state, os.path.join(path, "model"))
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=not adapter_only))
    if optimizer is not None:
        optimizer_state = get_optimizer_state_dict(model, optimizer)
        _load_dcp(optimizer_state, os.path.join(path, "optim"))
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    if lr_scheduler is not None:
        with open(state_file) as file:
            lr_scheduler.load_state_dict(json.load(file)["lr_scheduler"])


def _model_state(model: nn.Module, adapter_only: bool) -> dict:
    state = get_model_state_dict(model)
    return {name: tensor for name, tensor in state.items() if is_adapter_name(name)} if adapter_only else state


def _load_dcp(state_dict: dict, folder: str) -> None:
    """`dcp.load` with the metadata and non-tensor entries unpickled through the allow-lists."""
    dcp.load(state_dict, storage_reader=RestrictedFileSystemReader(folder), planner=RestrictedLoadPlanner())


def checkpoint_problem(path: str, with_optimizer: bool) -> str | None:
    """What would keep `load_checkpoint` from reading `path`, naming the file, or None: the
    schedule's state parses, and in `model/` (and `optim/` when `with_optimizer`) the DCP
    metadata reads within the allow-list and every shard it lists is there and as long as the
    metadata says (`dcp_folder_problem`)."""
    state_file = os.path.join(path, ENGINE_STATE_FILE)
    if not os.path.isfile(state_file):
        return f"{state_file} is missing"
    try:
        with open(state_file) as file:
            state = json.load(file)
    except ValueError as error:
        return f"{state_file} is not valid JSON, it is cut short or damaged ({error})"
    if not isinstance(state, dict) or "lr_scheduler" not in state:
        return f"{state_file} has no lr_scheduler entry; it was not written by the FSDP engine's save"
    for folder in ("model", "optim") if with_optimizer else ("model",):
        problem = dcp_folder_problem(os.path.join(path, folder))
        if problem is not None:
            return problem
    return None


def export_hf_model(out_dir: str, model: nn.Module, *, value_head: bool, dtype: str, attn_implementation: str,
                    tokenizer=None, lora_scales: dict[str, float] | None = None) -> None:
    """Write `model`'s full weights (stored in `dtype`), config and generation config as a HF directory;
    a LoRA model's (`lora_scales` of its adapted layers) with each adapter merged into its layer's weight.

    Every rank calls (the weights are gathered); rank 0 writes.
    """
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank() == 0:
        if lora_scales:
            full_state = dict(pair for bucket in merged_layers([list(full_state.items())], lora_scales,
                                                               resolve_dtype(dtype)) for pair in bucket)
        # save_pretrained on an empty model of the original class: the FSDP wrapper's class
        # name would otherwise be recorded as the architecture, and HF drops tied duplicates.
        shell = build_model_on_meta(model.config, value_head=value_head, dtype=dtype,
                                    attn_implementation=attn_implementation)
        if shell.can_generate():
            shell.generation_config = model.generation_config
        shell.save_pretrained(out_dir, state_dict=full_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()
