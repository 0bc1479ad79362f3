"""verl's newer SFT trainer (`verl.trainer.sft_trainer`, its `sft_trainer_engine.yaml`) as `ember sft` reads it.

That file composes `model/hf_model.yaml`, `engine/fsdp.yaml` and `optim/fsdp.yaml` at the top
level (`model.path`, `engine.*`, `optim.*`) where verl's older `sft_trainer.yaml`, ember's own
schema, has `model.partial_pretrain`, `model.fsdp_config.*` and `ulysses_sequence_parallel_size`.
The one thing to know: each key of the newer form is either another name of an ember field
(`SFT_ENGINE_ALIASES`, resolved as the file loads, so both forms load and print as ember's) or
one of verl's keys without an ember field (`SFT_ENGINE_VERL_KEYS`: accepted at verl's default,
noted or refused otherwise, ember/config/verl_keys.py). `--config-name sft_trainer_engine`
without a folder starts from `SFT_ENGINE_BASE`: that file's own values where they differ from
ember's defaults.
"""

from __future__ import annotations

from typing import Any

from ember.config.verl_keys import VerlKey

_FSDP_FIELDS = ("param_offload", "optimizer_offload", "offload_policy", "reshard_after_forward", "fsdp_size",
                "forward_prefetch", "model_dtype", "wrap_policy", "full_determinism")

SFT_ENGINE_ALIASES: dict[str, str] = {
    "model.path": "model.partial_pretrain",
    "model.use_remove_padding": "use_remove_padding",
    "model.custom_chat_template": "data.chat_template",
    "engine.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "engine.strategy": "model.strategy",
    **{f"engine.{name}": f"model.fsdp_config.{name}" for name in _FSDP_FIELDS},
    "optim.lr_warmup_steps_ratio": "optim.warmup_steps_ratio",
    "optim.lr_scheduler_type": "optim.lr_scheduler",
    "data.tools_key": "data.multiturn.tools_key",
}

_NOT_READ = "not read by ember sft"
SFT_ENGINE_VERL_KEYS: dict[str, VerlKey] = {
    "model.hf_config_path": VerlKey("the model's config is read from model.path", None, refuse=True),
    "model.override_config": VerlKey("the model's config is used as saved; edit its config.json", {}, refuse=True),
    "model.enable_activation_offload": VerlKey("activations stay on the GPU; use enable_gradient_checkpointing",
                                               False, refuse=True),
    "model.exclude_modules": VerlKey("LoRA's exclusions apply with model.lora_rank > 0 only", None),
    "model.use_fused_kernels": VerlKey("ember sft computes the token losses from the logits of each micro-batch",
                                       False),
    "model.fused_kernel_options": VerlKey("see model.use_fused_kernels"),
    "model.lora_adapter_path": VerlKey("LoRA starts from an adapter with model.lora_rank > 0 only", None),
    "model.tiled_mlp": VerlKey("the MLP runs whole; use enable_gradient_checkpointing", {"enabled": False}, refuse=True),
    "model.mtp": VerlKey("multi-token prediction is not built", {"enable": False}, refuse=True),
    "engine.use_orig_params": VerlKey("an FSDP1 setting; ember shards with FSDP2"),
    "engine.seed": VerlKey("ember sft seeds from trainer.seed"),
    "engine.dtype": VerlKey("ember computes in model.dtype (auto: bfloat16 on a GPU, float32 on CPU)", "bfloat16",
                            refuse=True),
    "engine.use_torch_compile": VerlKey("ember sft runs the model uncompiled"),
    "engine.entropy_from_logits_with_chunking": VerlKey("SFT computes no entropy", False),
    "engine.entropy_checkpointing": VerlKey("SFT computes no entropy", False),
    "engine.forward_only": VerlKey("ember sft trains", False, refuse=True),
    "optim.optimizer": VerlKey("ember sft uses torch's AdamW", "AdamW", refuse=True),
    "optim.optimizer_impl": VerlKey("ember sft uses torch's AdamW", "torch.optim", refuse=True),
    "optim.override_optimizer_config": VerlKey("AdamW takes lr, betas and weight_decay only", None, refuse=True),
    "optim.warmup_style": VerlKey("verl's older name; write optim.lr_scheduler_type (constant or cosine) instead",
                                  None, refuse=True),
    "optim.total_training_steps": VerlKey("the schedule's length is the run's steps", -1),
    "optim.lr_warmup_steps": VerlKey("warm-up is optim.lr_warmup_steps_ratio of the run's steps", -1, refuse=True),
    "optim.min_lr_ratio": VerlKey("the cosine schedule decays to 0", 0.0, refuse=True),
    "optim.num_cycles": VerlKey("the cosine schedule is half a cycle", 0.5, refuse=True),
    "data.pad_mode": VerlKey("ember packs with use_remove_padding (model.use_remove_padding) and pads otherwise; the "
                             "loss is the same either way"),
    "data.enable_thinking_key": VerlKey("a column of per-row enable_thinking flags is not read", "enable_thinking"),
    "data.ignore_input_ids_mismatch": VerlKey("conversations are rendered whole, so no per-turn mismatch arises"),
    "profiler": VerlKey("ember sft has no profiler", {"enable": False}, refuse=True),
    "trainer.profile_interval": VerlKey("ember sft has no profiler", [-1, -1], refuse=True),
    "checkpoint": VerlKey("ember sft's checkpoints hold the model, the optimizer and the run state",
                          {"save_contents": ["model", "optimizer", "extra"]}),
}

# sft_trainer_engine.yaml's values (with those of the groups it composes) where ember's defaults differ.
SFT_ENGINE_BASE: dict[str, Any] = {
    "data": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 8192},
    "optim": {"lr": 1e-3, "betas": [0.9, 0.999], "warmup_steps_ratio": 0.0, "lr_scheduler": "constant"},
    "use_remove_padding": True,
    "trainer": {"project_name": "gsm8k-sft", "experiment_name": "test", "seed": 1},
}
