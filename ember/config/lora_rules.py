"""LoRA's configuration rules, checked at load time for `ember train` (`actor_rollout_ref.model.lora_*`)
and `ember sft` (`model.lora_*`): each message names the key to change.

Checks that need the model (target names against its linear layers, an adapter folder's rank) run when
a command starts (`trainer/lora_setup.check_lora_model`).
"""

from __future__ import annotations

import importlib.util
from typing import Any


def lora_errors(section: str, model: Any, strategy: str | None, strategy_key: str) -> list[str]:
    """What is wrong with the LoRA keys of the model section at `section` (`model`), trained with `strategy`
    (named by `strategy_key`)."""
    if model.lora_rank == 0:
        if model.lora_adapter_path is not None:
            return [f"{section}.lora_adapter_path is set but {section}.lora_rank=0 (LoRA off); set lora_rank to the "
                    "adapter's rank (its adapter_config.json's r)"]
        return []
    errors = []
    if importlib.util.find_spec("peft") is None:
        errors.append(f"{section}.lora_rank={model.lora_rank} needs the peft package: pip install 'ember[lora]' "
                      "(or set lora_rank=0)")
    if model.lora_alpha <= 0:
        errors.append(f"{section}.lora_alpha={model.lora_alpha}: LoRA scales its update by lora_alpha / lora_rank; "
                      "choose lora_alpha > 0 (e.g. 2 × lora_rank)")
    if strategy == "megatron":
        errors.append(f"{section}.lora_rank={model.lora_rank} with {strategy_key}=megatron: ember's LoRA (PEFT's "
                      "modules) runs on FSDP2 only; set the strategy to fsdp2 or lora_rank=0")
    targets = model.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        errors.append(f"{section}.target_modules={targets}: write all-linear or a list of linear layer names, "
                      "e.g. [q_proj, v_proj]")
    elif not isinstance(targets, str) and not targets:
        errors.append(f"{section}.target_modules is an empty list: name the linear layers to adapt, or all-linear")
    return errors
