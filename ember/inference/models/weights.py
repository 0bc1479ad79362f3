"""Building an engine model from a HF config and filling its weights by name.

Weights come as (name, tensor) pairs in the checkpoint's own names: read from a HF
directory's safetensors files, or handed over by the training engine
(`named_parameters_for_sync`). The model is built on the meta device and materialised
empty, so its first load must supply every parameter; later loads (`update_weights`) may
send any subset, copied in place so the KV cache and any captured graphs stay valid, or
shared (the training engine's own tensors become the engine's weights, see `load_weights`).

MoE experts live in fused 3-D tensors (the names the training engine sends); a saved
checkpoint names each expert's matrices instead, and those names fill slices of the fused
tensors (`Experts.per_expert_views`), so both sources load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from ember.inference.models import fp8
from ember.inference.models.decoder import DecoderForCausalLM
from ember.inference.models.moe import Experts
from ember.inference.tensor_parallel import TensorParallel
from ember.models.weight_copy import copy_named_tensors

# Buffers some checkpoints carry that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(
    config: PretrainedConfig, max_positions: int, dtype: torch.dtype, device: torch.device, fuse_projections: bool = False,
    tensor_parallel: TensorParallel = TensorParallel(), quantization: str | None = None,
) -> DecoderForCausalLM:
    """An engine model for `config` on `device` in `dtype`, with uninitialised weights (load them next);
    `fuse_projections`: q/k/v and gate/up one matrix product each (`DecoderForCausalLM.fuse_projections`);
    `tensor_parallel`: build this rank's part of a split replica (load it with `shard`ed weights);
    `quantization`: "fp8" holds the decoder's projections in FP8 (`fp8.py`), None keeps them in `dtype`."""
    if quantization == "fp8":
        fp8.check_supported(device, dtype)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, max_positions, tensor_parallel)
        if quantization == "fp8":
            fp8.quantize_linears(model, device)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own parameter, splitting a tied pair
    for parameter in model.parameters():
        if parameter.dtype != fp8.FP8_DTYPE:
            parameter.data = parameter.data.to(dtype)
    model.model.rotary.reset_tables()
    if fuse_projections:
        model.fuse_projections()
    return model.eval().requires_grad_(False)


def load_weights(
    model: DecoderForCausalLM, named_tensors: Iterable[tuple[str, Tensor]], require_all: bool, share: bool = False
) -> bool:
    """Fill the model's parameters by name; `require_all` checks none was left out. Returns whether
    any parameter now lives in different memory (captured CUDA graphs must then be dropped).

    Tensors are copied in place; with `share`, a tensor whose shape, dtype and device match its
    parameter becomes that parameter's storage instead (no second copy: the training engine's
    live weights, which its optimizer then updates in place for both), except for parameters
    that are views of a fused weight (`model.fused_parameters`), which are always copied, and FP8
    weights, which are quantised in place as they arrive (`fp8.quantize_on_the_way`). A tied model's
    `lm_head.weight` is the embedding itself: both names write the same tensor. A fused expert
    tensor counts as loaded once every expert's slice of it was.
    """
    parameters = dict(model.named_parameters(remove_duplicate=False))
    expert_slices = per_expert_slices(model)
    targets = parameters | {name: view for slices in expert_slices.values() for name, view in slices.items()}
    wanted = ((name, own_part(model, name, tensor, targets)) for name, tensor in named_tensors
              if not name.endswith(_IGNORED_SUFFIXES))
    quantized: set[str] = set()
    wanted = fp8.quantize_on_the_way(wanted, fp8.quantized_weights(model), quantized)
    moved, shared = False, set()
    if share:
        wanted = list(wanted)
        for name, tensor in wanted:
            parameter = None if name in getattr(model, "fused_parameters", ()) else parameters.get(name)
            if parameter is not None and (parameter.shape, parameter.dtype, parameter.device) == (
                tensor.shape, tensor.dtype, tensor.device
            ):
                moved |= parameter.data_ptr() != tensor.data_ptr()
                parameter.data = tensor.detach()
                shared.add(name)
        wanted = [(name, tensor) for name, tensor in wanted if name not in shared]
    loaded = shared | copy_named_tensors(targets, wanted, owner=f"ember's {type(model).__name__}") | quantized
    if require_all:
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if "model.embed_tokens.weight" in loaded:
            loaded |= tied
        loaded |= {fused for fused, slices in expert_slices.items() if loaded.issuperset(slices)}
        missing = sorted(set(parameters) - loaded)
        if missing:
            raise ValueError(f"the weights given to the engine lack {len(missing)} parameters, e.g. {missing[:3]}")
    return moved


def own_part(model: DecoderForCausalLM, name: str, tensor: Tensor, targets: dict[str, Tensor]) -> Tensor:
    """This rank's part of `tensor` (whole, or this rank's part already) under tensor parallelism
    (`weight_shards.py`); a name the model lacks passes as it is, for the copy to refuse by name."""
    if name not in targets:
        return tensor
    return model.weight_shards.own_part(name, tensor, targets[name].shape)


def per_expert_slices(model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Each fused expert parameter's name -> {a checkpoint's per-expert name: the slice of it that name fills}."""
    return {
        f"{module_name}.{fused}": {f"{module_name}.{name}": view for name, view in views.items()}
        for module_name, module in model.named_modules()
        if isinstance(module, Experts)
        for fused, views in module.per_expert_views().items()
    }


def read_safetensors(path: str | Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of every *.safetensors file of a HF directory, one tensor in memory at a time."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}: give a HF model directory saved with safetensors")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """The HF config of a model directory (config.json), as transformers reads it."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: give a HF model directory")
    return AutoConfig.from_pretrained(path)


