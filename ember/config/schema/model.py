"""The policy model shared by actor, reference and rollout (`actor_rollout_ref.model`).

Speed switches default to off (use_remove_padding, use_fused_kernels: see
benchmarks/train_throughput.py for what they buy); switches for features ember has not
implemented yet are refused for a real run by `ember/config/features.py`.
"""

from dataclasses import dataclass
from typing import Any, Literal

from ember.config.schema.base import field_

ModelDType = Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
AttentionImplementation = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]


@dataclass
class LoraKeys:
    """verl's LoRA keys, the same in `ember train`'s `actor_rollout_ref.model` and `ember sft`'s `model`
    (`engines/lora.py`; rules in `config/lora_rules.py`)."""

    lora_rank: int = field_(0, "rank of LoRA adapters (PEFT's, FSDP2 only); 0 = train all weights")
    lora_alpha: float = field_(16, "LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)")
    target_modules: str | list[str] = field_(
        "all-linear", "linear layers that get LoRA adapters: all-linear (all but the LM head) or a list of names")
    exclude_modules: list[str] | None = field_(None, "linear layer names left without LoRA adapters; null = none")
    lora_adapter_path: str | None = field_(
        None, "PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start LoRA training from")


@dataclass
class ModelConfig(LoraKeys):
    """Which HF model the policy starts from and how it is built."""

    path: str | None = field_(None, "HF model directory or hub id; null = ember's built-in tiny model")
    tokenizer_path: str | None = field_(None, "tokenizer directory or hub id; null = path")
    external_lib: str | None = field_(
        None, "Python module imported before loading the model (registers custom architectures)")
    override_config: dict[str, Any] = field_(
        {}, "fields that replace those of the HF model config in the training engines (e.g. attention_dropout; "
        "output_router_logits: true adds a MoE model's load-balancing loss × router_aux_loss_coef to the actor's "
        "loss); each must be a field the config has")
    enable_gradient_checkpointing: bool = field_(True, "recompute activations in backward to save memory")
    enable_activation_offload: bool = field_(False, "move checkpointed activations to CPU between forward and backward")
    use_remove_padding: bool = field_(False, "pack sequences without padding (variable-length attention)")
    use_fused_kernels: bool = field_(False, "compute log-probs and entropy with fused kernels instead of full logits")
    trust_remote_code: bool = field_(False, "allow model and tokenizer code shipped with the checkpoint to run")
    use_liger: bool = field_(False, "replace layers with Liger kernels (GPU only)")
    dtype: ModelDType = field_("auto", "compute dtype of forward and backward; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: AttentionImplementation = field_("sdpa", "attention kernel passed to transformers")
