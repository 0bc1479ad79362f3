"""LoRA's options from a run's model section, and the checks that need the model itself.

`ember train` reads `actor_rollout_ref.model.lora_*`, `ember sft` reads `model.lora_*`: the same
fields (`config/schema/model.py`, `config/schema/sft.py`), turned here into the engine's
`LoraOptions`. The load-time rules that need no model are `config/lora_rules.py`.
"""

from __future__ import annotations

from typing import Any

from ember.engines.lora import LoraOptions, adapter_folder_config, check_lora_targets


def lora_options(model_cfg: Any, key: str) -> LoraOptions | None:
    """The LoRA options of the model section `model_cfg` (at config path `key`); None when lora_rank is 0."""
    if not model_cfg.lora_rank:
        return None
    targets = model_cfg.target_modules
    return LoraOptions(rank=model_cfg.lora_rank, alpha=float(model_cfg.lora_alpha),
                       target_modules=targets if isinstance(targets, str) else tuple(targets),
                       exclude_modules=tuple(model_cfg.exclude_modules or ()), adapter_path=model_cfg.lora_adapter_path,
                       key=key)


def check_lora_model(options: LoraOptions | None, model_path: str, trust_remote_code: bool) -> None:
    """Before any work: the target and excluded names are linear layers of the model at `model_path`, and a
    `lora_adapter_path` is an adapter folder of the configured rank (errors name the key)."""
    if options is None:
        return
    from ember.models.loading import build_model_on_meta, load_model_config  # transformers' model classes

    model = build_model_on_meta(load_model_config(model_path, trust_remote_code=trust_remote_code),
                                trust_remote_code=trust_remote_code)
    check_lora_targets(options, model)
    if options.adapter_path:
        adapter_folder_config(options)
