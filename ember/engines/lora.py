"""LoRA on a Hugging Face model with PEFT's modules: adding the adapters, the base model without
them, merged weights for the rollout engine and export, and PEFT's adapter folder.

The one thing to know: PEFT's `inject_adapter_in_model` replaces each targeted `nn.Linear` in place
(the model keeps its class) by a LoRA layer holding the frozen original as `base_layer` and the
trained low-rank pair `lora_A.default` [r, in], `lora_B.default` [out, r]; its output is
`base(x) + scale · B(A(x))` with scale = lora_alpha / r. So parameter names gain `.base_layer`
and the adapter's tensors (`hf_name` maps back to the model's own names), and the merged weight a
generation engine or a Hugging Face folder needs is `base + scale · B @ A` (`merge_weight`),
always computed into new tensors: the trained module itself is never merged in place. Base
weights are frozen (`requires_grad=False`, so no optimizer state; the FSDP2 engine stores them in
the compute dtype) and adapters are stored in fp32.
`peft` is an optional extra (`pip install 'ember[lora]'`), imported only where LoRA is on; a run that
asks for LoRA without it is refused at load time (`config/lora_rules.py`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ember.errors import UserError

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER = "default"
"""PEFT's name for the one adapter a model holds (it appears in parameter names)."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""How PEFT's adapter files name a module: under its PeftModel's wrappers."""


@dataclass(frozen=True)
class LoraOptions:
    """Which layers get adapters and of what size (verl's `model.lora_*` keys)."""

    rank: int
    """r: the inner size of each adapter pair."""
    alpha: float
    """The update is scaled by alpha / rank."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """"all-linear" (every linear layer but the LM head) or module names (last name component)."""
    exclude_modules: tuple[str, ...] = ()
    """Module names left without adapters."""
    adapter_path: str | None = None
    """A PEFT adapter folder to start from: its config decides the adapted layers and alpha (its rank must equal
    `rank`), its weights the start."""
    key: str = "actor_rollout_ref.model"
    """The config section these came from, named in errors."""

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets,
                          exclude_modules=list(self.exclude_modules) or None, lora_dropout=0.0, bias="none")


def linear_module_names(model: nn.Module) -> set[str]:
    """The last name component of each linear layer that may take an adapter (all but the LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head}


def check_lora_targets(options: LoraOptions, model: nn.Module) -> None:
    """Refuse target or excluded module names the model has no linear layer of, naming the key to change."""
    known = linear_module_names(model)
    for field, names in (("target_modules", () if options.target_modules == "all-linear" else options.target_modules),
                         ("exclude_modules", options.exclude_modules)):
        unknown = sorted(set(names) - known)
        if unknown:
            raise UserError(f"{options.key}.{field}: {', '.join(unknown)} is not a linear layer of "
                            f"{type(model).__name__}; its linear layers are {', '.join(sorted(known))} "
                            "(or write all-linear)")
    if options.exclude_modules and options.target_modules == "all-linear" and known <= set(options.exclude_modules):
        raise UserError(f"{options.key}.exclude_modules leaves no linear layer for LoRA; exclude fewer modules")


def adapter_folder_config(options: LoraOptions) -> LoraConfig:
    """The LoRA config of `options.adapter_path`, refused by name where `lora_rank` says otherwise."""
    path = options.adapter_path
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG_FILE)) or not os.path.isfile(
            os.path.join(path, ADAPTER_WEIGHTS_FILE)):
        raise UserError(f"{options.key}.lora_adapter_path={path} is not a PEFT adapter folder: it needs "
                        f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}")
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(path)
    if config.r != options.rank:
        raise UserError(f"{options.key}.lora_rank={options.rank} but the adapter at lora_adapter_path={path} has "
                        f"rank {config.r}; set lora_rank={config.r}")
    return config


def add_lora(model: nn.Module, options: LoraOptions, base_dtype: torch.dtype | None = None) -> None:
    """PEFT's LoRA layers into `model` in place (on any device, meta too): base weights frozen (stored in
    `base_dtype` where given: the compute dtype, as they never take an optimizer step, so a 7B base holds
    15 GB in bf16 rather than 30 in fp32), adapters in fp32, initialised as PEFT does (A random, B zero) from
    torch's current seed."""
    from peft import inject_adapter_in_model

    check_lora_targets(options, model)
    config = adapter_folder_config(options) if options.adapter_path else options.peft_config()
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        adapter = is_adapter_name(name)
        parameter.requires_grad_(adapter)
        if adapter:
            parameter.data = parameter.data.float()
        elif base_dtype is not None:
            parameter.data = parameter.data.to(base_dtype)


def load_adapter_weights(model: nn.Module, options: LoraOptions) -> None:
    """The weights of the PEFT adapter folder `options.adapter_path` into `model`'s adapters (added by `add_lora`
    from the folder's config)."""
    path = options.adapter_path
    saved = load_file(os.path.join(path, ADAPTER_WEIGHTS_FILE))
    ours = {from_peft_name(name): tensor for name, tensor in saved.items()}
    own = dict(model.named_parameters())
    missing = sorted(name for name in own if is_adapter_name(name) and name not in ours)
    extra = sorted(set(ours) - set(own))
    if missing or extra:
        what = f"{missing[0]} is not in its file" if missing else f"its {extra[0]} is not in the model"
        raise UserError(f"{options.key}.lora_adapter_path={path} is an adapter of another model: {what}; point "
                        "lora_adapter_path at an adapter of this model")
    with torch.no_grad():
        for name, tensor in ours.items():
            own[name].copy_(tensor)


def is_adapter_name(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def hf_name(name: str) -> str:
    """A parameter's name in the model without adapters (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def to_peft_name(name: str) -> str:
    """`...q_proj.lora_A.default.weight` as PEFT's adapter file names it."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def from_peft_name(name: str) -> str:
    body = name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        body = body.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return body


def lora_scales(model: nn.Module) -> dict[str, float]:
    """Each LoRA layer's module name and its scale (alpha / r)."""
    from peft.tuners.lora import LoraLayer

    return {name: module.scaling[ADAPTER] for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Forwards in the block compute the base model (what PEFT's `disable_adapter()` does, on a model
    without the PeftModel wrapper): the adapters are skipped, not removed or changed. Only the flag
    PEFT's forward reads is set: its `enable_adapters` also switches the adapters' `requires_grad`, and
    FSDP2's unsharded parameters do not take that back (the next backward would find nothing to train)."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def merge_weight(base: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, dtype: torch.dtype | None = None) -> Tensor:
    """base + scale · B @ A, computed in fp32 into a new tensor, in `dtype` (default: the base's)."""
    return (base.float() + scale * (lora_b.float() @ lora_a.float())).to(dtype or base.dtype)


def layer_tensor_names(module_name: str) -> tuple[str, str, str]:
    """(base weight, A, B) parameter names of the LoRA layer `module_name`."""
    return (f"{module_name}.base_layer.weight", f"{module_name}.lora_A.{ADAPTER}.weight",
            f"{module_name}.lora_B.{ADAPTER}.weight")


def merged_layers(buckets: Iterable[list[tuple[str, Tensor]]], scales: dict[str, float],
                  dtype: torch.dtype) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of whole tensors in, buckets of weights under the model's own names out: each LoRA
    layer's base weight, A and B become its merged weight (in `dtype`) once all three have arrived,
    adapter tensors are dropped, every other tensor is renamed (`hf_name`) and cast to `dtype`."""
    owner = {tensor_name: module for module in scales for tensor_name in layer_tensor_names(module)}
    waiting: dict[str, dict[str, Tensor]] = {}
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            module = owner.get(name)
            if module is None:
                out.append((hf_name(name), tensor.to(dtype)))
                continue
            parts = waiting.setdefault(module, {})
            parts[name] = tensor
            if len(parts) == 3:
                done = waiting.pop(module)
                base, lora_a, lora_b = (done[part] for part in layer_tensor_names(module))
                out.append((f"{module}.weight", merge_weight(base, lora_a, lora_b, scales[module], dtype)))
        if out:
            yield out
    if waiting:
        raise RuntimeError(f"LoRA layers {sorted(waiting)} did not arrive whole; every bucket must be consumed")


def write_adapter_folder(out_dir: str, adapter_state: dict[str, Tensor], model: nn.Module, base_model_path: str) -> None:
    """PEFT's adapter folder (`adapter_config.json`, `adapter_model.safetensors`) of `model`'s adapter,
    whose whole tensors are `adapter_state` (under the model's parameter names), for
    `PeftModel.from_pretrained(base, out_dir)`."""
    config: LoraConfig = copy.copy(model.peft_config[ADAPTER])  # the trained model's own config stays as it is
    config.base_model_name_or_path = base_model_path
    config.inference_mode = True
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({to_peft_name(name): tensor.contiguous() for name, tensor in adapter_state.items()},
              os.path.join(out_dir, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
