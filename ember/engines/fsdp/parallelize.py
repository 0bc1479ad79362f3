"""How a Hugging Face model is prepared for FSDP2 training, as plain functions in a fixed order.

`parallelize_model` applies, in this order: Liger kernels (if asked), activation checkpointing of the decoder layers
(it must be set before sharding wraps the layers' forward), then `fully_shard` of every
decoder layer and finally of the root (embeddings, final norm, LM or value head, and the
tied weights if any, which must share one FSDP group). Each decoder layer is one unit of
all-gather and reduce-scatter, so at most one layer's full weights is alive at a time
beside the root's.

With `shard_layers=False` (one rank, weights on the device) the root is the only unit:
nothing is sharded there, so a unit per layer would only add its hooks (host work before
and after every layer's forward and backward, which sets the pace of a small model's
update); the whole model's weights are cast once before forward and its gradients reduced
once after backward. That costs memory per-layer units never hold at once: the whole
model's compute-dtype gradients until the end of backward and its one gradient reduce's
input and output buffers (about ROOT_UNIT_BYTES_PER_PARAMETER in all), so the root alone is
used only where that stays under ROOT_UNIT_MEMORY_FRACTION of the device (`root_unit_fits`).

Mixed precision keeps the sharded (master) parameters in their stored dtype, casts them to
`param_dtype` when gathered for compute, and reduces gradients in `reduce_dtype`. With
`offload_policy` (FSDP2's CPUOffloadPolicy) the shards, their gradients and the optimizer
step live in pinned CPU memory; each layer's weights are copied to the device to compute.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import PreTrainedModel

from ember.errors import UserError


ROOT_UNIT_BYTES_PER_PARAMETER = 10
"""Device bytes per parameter that one unit over the whole model holds at the end of backward beyond
per-layer units: its bf16 gradients (2) and its reduce's fp32 input and output (4 + 4)."""
ROOT_UNIT_MEMORY_FRACTION = 0.1
"""The share of the device's memory that extra may take for the root to be the only unit."""


def root_unit_fits(model: nn.Module, device: torch.device) -> bool:
    """Whether one FSDP2 unit over the whole model keeps its end-of-backward extra memory within
    ROOT_UNIT_MEMORY_FRACTION of `device` (always on a CPU: host memory, and nothing is faster there)."""
    if device.type == "cpu":
        return True
    parameters = sum(parameter.numel() for parameter in model.parameters())
    total = torch.accelerator.get_memory_info(device)[1]
    return parameters * ROOT_UNIT_BYTES_PER_PARAMETER <= ROOT_UNIT_MEMORY_FRACTION * total


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The model's transformer blocks: the modules HF lists in `_no_split_modules`."""
    block_names = set(model._no_split_modules or ())
    layers = [module for module in model.modules() if type(module).__name__ in block_names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no decoder-layer class in _no_split_modules; "
                         "FSDP needs one to shard the model layer by layer")
    return layers


def apply_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them (transformers
    renamed the switch to `activation_checkpointing_enable` in 5.2x; the old name warns)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "activation_checkpointing_kwargs" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_fsdp(model: PreTrainedModel, mesh: DeviceMesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, offload_policy: bool = False, shard_layers: bool = True) -> None:
    """Shard every decoder layer (unless not `shard_layers`), then the root, over `mesh` with the
    given mixed precision (and the shards in pinned CPU memory with `offload_policy`)."""
    settings = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                    reshard_after_forward=reshard_after_forward,
                    offload_policy=CPUOffloadPolicy(pin_memory=True) if offload_policy else OffloadPolicy())
    for layer in decoder_layers(model) if shard_layers else ():
        fully_shard(layer, **settings)
    fully_shard(model, **settings)


def compile_decoder_layers(model: PreTrainedModel) -> None:
    """torch.compile each decoder layer's forward, with dynamic shapes (one compilation serves every
    micro-batch length). Only `forward` is compiled: FSDP2's gather and free hooks and the
    activation-checkpointing wrapper run around it as before, so the layer stays the same module
    under the same parameter names; the layer's many small element-wise kernels (norms, RoPE,
    SwiGLU, casts) fuse into a few."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def apply_liger_kernels(model: PreTrainedModel) -> None:
    """liger-kernel's Triton RMSNorm, SwiGLU MLP and RoPE in place of the model's own (what verl's
    `model.use_liger` applies; its fused linear cross-entropy is left out: ember computes log-probs
    itself, `use_fused_kernels`). A model type liger-kernel has no kernels for is refused, not run
    without them. liger-kernel also swaps transformers' classes and RoPE function of that model type
    for the whole process, so models of the type built afterwards in this process (a critic, an hf
    rollout's own model) compute with its kernels too (the same math). For MoE types its SwiGLU may
    replace the experts' grouped implementation (not measured)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as error:
        raise UserError("use_liger=true (actor_rollout_ref.model.use_liger; model.use_liger in ember sft) needs the "
                        "liger-kernel package: pip install liger-kernel, or set use_liger=false") from error
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UserError(f"use_liger=true: liger-kernel has no kernels for model type "
                        f"{model_type!r} (it has {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set use_liger=false")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def parallelize_model(model: PreTrainedModel, mesh: DeviceMesh, *, gradient_checkpointing: bool,
                      param_dtype: torch.dtype, reduce_dtype: torch.dtype, reshard_after_forward: bool,
                      offload_policy: bool = False, compile_layers: bool = False, shard_layers: bool = True,
                      liger: bool = False) -> None:
    """Liger kernels (if asked), activation checkpointing (if asked), layer compilation (if asked), then
    FSDP2 sharding (a unit per decoder layer, or with `shard_layers=False` the root alone); modifies
    `model` in place."""
    if liger:
        apply_liger_kernels(model)
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    if compile_layers:
        compile_decoder_layers(model)
    apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
               reshard_after_forward=reshard_after_forward, offload_policy=offload_policy, shard_layers=shard_layers)
