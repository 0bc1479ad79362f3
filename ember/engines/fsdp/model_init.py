"""Building a sharded model from a Hugging Face checkpoint with one read of the weights.

Rank 0 reads the checkpoint onto its CPU; every rank (rank 0 too) builds the same
architecture on the meta device, parallelizes it, allocates only its own shards on its
device, and receives the weights broadcast from rank 0. CPU memory therefore holds one
full copy of the model per node's first rank instead of one per process, and a freshly
initialised value head is the same on every rank.

Non-persistent buffers (rotary-embedding frequencies) are not in a state dict; they are
copied from rank 0's loaded model and broadcast as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from ember.distributed.device import rank
from ember.engines.fsdp.offload import CPU, move_parameters
from ember.engines.lora import LoraOptions, add_lora, load_adapter_weights
from ember.engines.fsdp.parallelize import parallelize_model, root_unit_fits
from ember.models.loading import build_model_on_meta, load_model, load_model_config, resolve_dtype


def build_sharded_model(model_path: str, mesh: DeviceMesh, device: torch.device, *, value_head: bool,
                        model_dtype: str, param_dtype: str, reduce_dtype: str, attn_implementation: str,
                        gradient_checkpointing: bool, reshard_after_forward: bool,
                        offload_policy: bool = False, compile_layers: bool = False, shard_layers: bool = True,
                        liger: bool = False, keep_layers: int | None = None, overrides: dict | None = None,
                        trust_remote_code: bool = False, lora: LoraOptions | None = None) -> PreTrainedModel:
    """The checkpoint at `model_path` as an FSDP2 module whose shards live on `device` (in pinned
    CPU memory with `offload_policy`; buffers such as RoPE tables stay on `device`); with
    `keep_layers`, only its first decoder layers; `overrides` replace fields of its config;
    `shard_layers`: a FSDP2 unit per decoder layer, or (False) the root alone where the model is small
    enough for it (`parallelize.root_unit_fits`); with `lora`, PEFT's LoRA layers added before sharding (rank 0's
    adapters, initialised from the current seed or read from `lora.adapter_path`, are broadcast with the weights)
    and the frozen base stored in `param_dtype`, the dtype it computes in."""
    config = load_model_config(model_path, value_head=value_head, keep_layers=keep_layers, overrides=overrides,
                               trust_remote_code=trust_remote_code)
    pretrained = None
    if rank() == 0:
        pretrained = load_model(model_path, value_head=value_head, dtype=model_dtype,
                                attn_implementation=attn_implementation, keep_layers=keep_layers, overrides=overrides,
                                trust_remote_code=trust_remote_code)
        if lora is not None:
            add_lora(pretrained, lora, base_dtype=resolve_dtype(param_dtype))
            if lora.adapter_path:
                load_adapter_weights(pretrained, lora)
    model = build_model_on_meta(config, value_head=value_head, dtype=model_dtype,
                                attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if lora is not None:
        add_lora(model, lora, base_dtype=resolve_dtype(param_dtype))
    shard_layers = shard_layers or not root_unit_fits(model, device)
    parallelize_model(model, mesh, gradient_checkpointing=gradient_checkpointing,
                      param_dtype=resolve_dtype(param_dtype), reduce_dtype=resolve_dtype(reduce_dtype),
                      reshard_after_forward=reshard_after_forward, offload_policy=offload_policy,
                      compile_layers=compile_layers, shard_layers=shard_layers, liger=liger)
    model.to_empty(device=device)
    full_state = pretrained.state_dict() if pretrained is not None else {}
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded_buffers = dict(pretrained.named_buffers()) if pretrained is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if pretrained is not None:
                buffer.copy_(loaded_buffers[name])
            dist.broadcast(buffer, src=0)
    if offload_policy:  # loaded on the device (the broadcast needs it there); the shards now move to CPU
        move_parameters(model, CPU, buffers_stay_on=device)
    if pretrained is not None and pretrained.can_generate():
        model.generation_config = pretrained.generation_config  # the checkpoint's; only rank 0 exports
    return model

