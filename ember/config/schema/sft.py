"""`SFTConfig`, the configuration of `ember sft`, accepting verl's sft_trainer keys and a Megatron-style dialect.

The second dialect (`training.micro_batch_size_per_gpu`, `training.use_rmpad`,
`data.sequence_length`, `model.megatron`) is read through `key_aliases`: an alias is
rewritten to the verl key it means before anything else, so code reads one name only.
`training.gradient_accumulation_steps` has no verl twin; when given it must agree with the
batch sizes (checked in `ember/config/validate.py`).
"""

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ember.config.schema.base import Strategy, field_, section
from ember.config.schema.data import CustomClassConfig, Truncation
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.megatron import MegatronConfig
from ember.config.schema.model import AttentionImplementation, LoraKeys, ModelDType
from ember.config.schema.trainer import RunConfig
from ember.config.verl_keys import SFT_VERL_KEYS, VerlKey
from ember.config.verl_sft_engine import SFT_ENGINE_ALIASES, SFT_ENGINE_BASE, SFT_ENGINE_VERL_KEYS


@dataclass
class MultiturnConfig:
    """Conversations stored as message lists instead of prompt/response columns."""

    enable: bool = field_(False, "read each row's conversation from messages_key; loss on assistant turns only")
    messages_key: str = field_("messages", "column holding the list of chat messages")
    tools_key: str = field_("tools", "column holding tool schemas passed to the chat template")


@dataclass
class SFTDataConfig:
    """Supervised examples and the batch size of one optimizer step."""

    train_files: str | list[str] | None = field_(None, "parquet file(s) of training examples; null = ember's built-in task")
    val_files: str | list[str] | None = field_(None, "parquet file(s) of validation examples; null = no validation")
    prompt_key: str = field_("question", "column holding the prompt (single-turn)")
    response_key: str = field_("answer", "column holding the target response (single-turn)")
    multiturn: MultiturnConfig = section(MultiturnConfig, "multi-turn conversations")
    max_length: int = field_(1024, "longest example in tokens (prompt + response)")
    truncation: Truncation = field_(
        "error", "what to do with an example over max_length: error, or cut it on the left, right or middle")
    train_max_samples: int = field_(-1, "use only the first this many rows of train_files (-1: all), as verl's SFT "
                                        "dataset does without a data.shuffle key")
    val_max_samples: int = field_(-1, "the same for val_files")
    train_batch_size: int = field_(256, "examples per optimizer step over all GPUs")
    micro_batch_size_per_gpu: int = field_(4, "examples per forward/backward on one GPU")
    use_dynamic_bsz: bool = field_(False, "form micro-batches by a token budget instead of micro_batch_size_per_gpu")
    max_token_len_per_gpu: int = field_(16384, "tokens per micro-batch with use_dynamic_bsz")
    chat_template: str | None = field_(None, "Jinja chat template replacing the tokenizer's; null = the tokenizer's")
    custom_cls: CustomClassConfig = section(CustomClassConfig, "a user-defined dataset class")


@dataclass
class SFTModelConfig(LoraKeys):
    """The model being fine-tuned and its backend."""

    partial_pretrain: str | None = field_(
        None, "HF model directory or hub id to fine-tune; null = ember's built-in tiny model")
    tokenizer_path: str | None = field_(None, "tokenizer directory or hub id; null = partial_pretrain")
    external_lib: str | None = field_(None, "Python module imported before loading the model")
    enable_gradient_checkpointing: bool = field_(True, "recompute activations in backward to save memory")
    trust_remote_code: bool = field_(False, "allow model and tokenizer code shipped with the checkpoint to run")
    use_liger: bool = field_(False, "replace layers with Liger kernels (GPU only)")
    dtype: ModelDType = field_("auto", "compute dtype of forward and backward; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: AttentionImplementation = field_("sdpa", "attention kernel passed to transformers")
    strategy: Strategy | None = field_(None, "training backend; null = megatron when model.megatron is given, else fsdp2")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offloading (strategy fsdp / fsdp2)")
    megatron: MegatronConfig | None = field_(None, "Megatron parallel layout; giving it selects strategy megatron")


@dataclass
class SFTOptimConfig:
    """AdamW and the learning-rate schedule of fine-tuning."""

    lr: float = field_(1e-5, "peak learning rate")
    betas: list[float] = field_([0.9, 0.95], "AdamW moment decay rates [beta1, beta2]")
    weight_decay: float = field_(0.01, "AdamW decoupled weight decay")
    warmup_steps_ratio: float = field_(0.1, "linear warmup length as a fraction of the training steps")
    clip_grad: float = field_(1.0, "gradients are rescaled so that their global L2 norm is at most this")
    lr_scheduler: Literal["constant", "cosine"] = field_("cosine", "after warmup: constant keeps lr, cosine decays it to 0")


@dataclass
class TrainingConfig:
    """The Megatron-style dialect's `training` section (its other keys are aliases, see SFTConfig)."""

    gradient_accumulation_steps: int | None = field_(
        None, "micro-batches per optimizer step on each GPU; null = train_batch_size / (micro_batch_size_per_gpu × data-parallel size)")


@dataclass
class SFTTrainerConfig(RunConfig):
    """An SFT run: RunConfig plus checkpoint retention."""

    total_epochs: int = field_(4, "passes over the training data")
    max_ckpt_to_keep: int | None = field_(None, "checkpoints kept on disk; null = all")


@dataclass
class SFTConfig:
    """Everything `ember sft` needs."""

    builtin_bases: ClassVar[dict[str, dict[str, Any]]] = {"sft_trainer": {}, "sft_trainer_engine": SFT_ENGINE_BASE}
    key_aliases: ClassVar[dict[str, str]] = {
        "training.micro_batch_size_per_gpu": "data.micro_batch_size_per_gpu",
        "training.use_rmpad": "use_remove_padding",
        "data.sequence_length": "data.max_length",
        "data.messages_key": "data.multiturn.messages_key",
        "model.fsdp_config.cpu_offload": "model.fsdp_config.offload_policy",
        "model.fsdp_config.offload_params": "model.fsdp_config.offload_policy",
        **SFT_ENGINE_ALIASES,
    }
    verl_keys: ClassVar[dict[str, VerlKey]] = {**SFT_VERL_KEYS, **SFT_ENGINE_VERL_KEYS}  # verl's keys without a field

    data: SFTDataConfig = section(SFTDataConfig, "supervised examples and batch size")
    model: SFTModelConfig = section(SFTModelConfig, "the model being fine-tuned")
    optim: SFTOptimConfig = section(SFTOptimConfig, "optimizer and learning-rate schedule")
    training: TrainingConfig = section(TrainingConfig, "gradient accumulation (Megatron-style dialect)")
    ulysses_sequence_parallel_size: int = field_(
        1, "Ulysses sequence parallel size (FSDP): each sequence is split over this many GPUs")
    use_remove_padding: bool = field_(False, "pack sequences without padding (variable-length attention)")
    trainer: SFTTrainerConfig = section(SFTTrainerConfig, "the run: GPUs, logging, checkpoints")
