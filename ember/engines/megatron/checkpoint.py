"""Megatron checkpoints: megatron-core's distributed checkpointing in, a HF folder out.

`save` writes the model chunks and the optimizer (fp32 master weights and Adam moments,
sharded as the distributed optimizer holds them) with `dist_checkpointing`. The model's
sharded tensors carry their global shapes and offsets, so the weights reload under another
parallel layout; the optimizer state is written `dp_reshardable` (each rank its own buffers,
in parallel), which megatron-core reshards over data-parallel ranks only, so the engine refuses a
resume under other model-parallel sizes by name (`fully_reshardable`, which would allow it, failed
to load in megatron-core 0.16 without Transformer Engine on a CPU: it expects an Adam step it does
not save; not tried on 0.19).
`export_hf` gathers the full weights through mbridge into safetensors that transformers loads.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from ember.engines.dcp_folder import dcp_folder_problem
from ember.engines.megatron.bridge import unwrapped

_REQUIRED = ("metadata.json",)


_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""megatron-core's default layout of the distributed optimizer's state (each rank writes its
own buffers in parallel)."""


def _sharded_state_dict(chunks: list[nn.Module], optimizer, is_loading: bool) -> dict:
    chunks = [unwrapped(chunk) for chunk in chunks]
    if len(chunks) == 1:
        state = {"model": chunks[0].sharded_state_dict(metadata=_METADATA)}
    else:
        state = {f"model{index}": chunk.sharded_state_dict(metadata=_METADATA) for index, chunk in enumerate(chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_METADATA)
    return state


def save_checkpoint(path: str, chunks: list[nn.Module], optimizer) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), path)


def load_checkpoint(path: str, chunks: list[nn.Module], optimizer, optimizer_steps: int) -> None:
    """Load `path` into `chunks` and `optimizer`; `optimizer_steps` (the optimizer steps taken before the save,
    which the engine keeps beside the checkpoint) becomes every parameter's Adam step count."""
    from megatron.core import dist_checkpointing

    if optimizer is not None:
        _create_optimizer_state(optimizer)
    state = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True), path)
    chunks = [unwrapped(chunk) for chunk in chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"])
    else:
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{index}"])
    if optimizer is not None:
        with torch.no_grad():  # fp32 parameters: the distributed optimizer copies into views of them
            optimizer.load_state_dict(state["optimizer"])
        _set_step_counts(optimizer, optimizer_steps)


def _create_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors (and step count), which loading fills in place.

    megatron-core builds the loading layout from the existing state; a PyTorch Adam has none
    before its first step. One step at learning rate 0 on zero gradients creates it and
    changes no weight (Adam's update and AdamW's decay are both scaled by the learning rate).
    """
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        if inner.state:
            continue
        rates = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for parameter in group["params"]:
                parameter.grad = torch.zeros_like(parameter)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, rate in zip(inner.param_groups, rates):
            group["lr"] = rate


def _set_step_counts(optimizer, steps: int) -> None:
    """Give every parameter its own Adam step count, `steps`.

    Without Transformer Engine or Apex, megatron-core's distributed optimizer does not bring the
    count back: loading `dp_reshardable` state copies the step of the loading template (the one
    `_create_optimizer_state` made, 1) over the saved one, so every later update used the wrong
    bias correction (found on CPU with megatron-core 0.19.2: moments and master weights equal after
    the load, the count 1 instead of 3). It also hands one step tensor to every parameter, which
    PyTorch's Adam would advance once per parameter per step. The engine counts the steps itself.
    """
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        for parameter_state in megatron_optimizer.optimizer.state.values():
            step = parameter_state.get("step")
            if isinstance(step, torch.Tensor):
                parameter_state["step"] = torch.full_like(step, float(steps))


def checkpoint_problem(path: str, extra_files: list[str]) -> str | None:
    """None when `path` holds the files a load reads; else which one is missing, empty, cut short or
    holds a pickle that would run code. megatron-core's load reads the DCP metadata and its sharded
    objects with plain pickle, so `dcp_folder_problem` reads both first within the allow-lists
    (`common.pt` megatron-core reads with torch.load's default, weights_only)."""
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    for name in (*_REQUIRED, *extra_files):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{os.path.join(path, name)} is missing"
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if os.path.isfile(file) and os.path.getsize(file) == 0:
            return f"{file} is empty"
    return dcp_folder_problem(path, read_entries=True)


def export_hf(out_dir: str, bridge, chunks: list[nn.Module], model_path: str, tokenizer=None,
              value_head: bool = False) -> None:
    """A HF folder: the weights (gathered from every parallel shard), the model's config and
    generation config, and the tokenizer when given; a critic as a one-label token-classification
    model (what the FSDP2 critic writes). Every rank calls; rank 0 writes."""
    if value_head:
        _export_value_model(out_dir, bridge, chunks)
    else:
        bridge.save_weights(chunks, out_dir)
    if dist.get_rank() == 0:
        generation_config = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(generation_config) and not value_head:
            shutil.copy(generation_config, out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()


def _export_value_model(out_dir: str, bridge, chunks: list[nn.Module]) -> None:
    from safetensors.torch import save_file

    from ember.engines.megatron.bridge import hf_named_weights
    from ember.models.value_model import value_model_config

    weights = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in hf_named_weights(bridge, chunks)}
    if dist.get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = value_model_config(bridge.hf_config)
    config.architectures = [architecture.replace("ForCausalLM", "ForTokenClassification")
                            for architecture in (config.architectures or [])]
    config.tie_word_embeddings = False
    config.save_pretrained(out_dir)
