"""The critic (value model) of PPO with GAE: its model, batching, loss and backend.

`enable: null` lets the advantage estimator decide (on for gae, off otherwise). Most
batching fields follow the actor's, as in verl.
"""

from dataclasses import dataclass
from typing import Any

from ember.config.schema.actor import CheckpointConfig, LossAggMode
from ember.config.schema.base import Strategy, field_, follow, section
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.megatron import MegatronConfig
from ember.config.schema.model import AttentionImplementation, ModelDType
from ember.config.schema.optim import OptimConfig

_ACTOR = "actor_rollout_ref.actor"
_MODEL = "actor_rollout_ref.model"


@dataclass
class CriticModelConfig:
    """The value model: an HF causal LM whose head is replaced by a scalar value head."""

    path: str | None = follow(f"{_MODEL}.path", "HF model directory or hub id the critic starts from")
    tokenizer_path: str | None = field_(None, "tokenizer directory; null = the policy's tokenizer")
    override_config: dict[str, Any] = field_({}, "fields that replace those of the HF model config in training; each "
                                                 "must be a field the config has")
    external_lib: str | None = follow(f"{_MODEL}.external_lib", "Python module imported before loading the model")
    enable_gradient_checkpointing: bool = field_(True, "recompute activations in backward to save memory")
    enable_activation_offload: bool = field_(False, "move checkpointed activations to CPU between forward and backward")
    use_remove_padding: bool = field_(False, "pack sequences without padding (variable-length attention)")
    dtype: ModelDType = follow(f"{_MODEL}.dtype", "compute dtype of forward and backward; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: AttentionImplementation = follow(f"{_MODEL}.attn_implementation", "attention kernel passed to transformers")
    trust_remote_code: bool = follow(f"{_MODEL}.trust_remote_code", "allow code shipped with the checkpoint to run")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offloading of the critic")


@dataclass
class CriticConfig:
    """How the critic is trained."""

    enable: bool | None = field_(None, "train a critic; null = only when algorithm.adv_estimator is gae")
    strategy: Strategy = follow(f"{_ACTOR}.strategy", "training backend of the critic")
    optim: OptimConfig = section(OptimConfig, "optimizer and learning-rate schedule of the critic", lr=1e-5)
    model: CriticModelConfig = section(CriticModelConfig, "the value model")
    megatron: MegatronConfig = section(MegatronConfig, "Megatron parallel layout and offloading (strategy megatron)")
    ppo_mini_batch_size: int = follow(f"{_ACTOR}.ppo_mini_batch_size", "prompts per critic optimizer step")
    ppo_micro_batch_size: int | None = field_(
        None, "deprecated: micro-batch over all GPUs; use ppo_micro_batch_size_per_gpu")
    ppo_micro_batch_size_per_gpu: int | None = field_(
        None, "responses per forward/backward on one GPU; null = whole per-GPU mini-batch")
    forward_micro_batch_size_per_gpu: int | None = follow(
        ".ppo_micro_batch_size_per_gpu", "responses per value forward on one GPU")
    use_dynamic_bsz: bool = follow(f"{_ACTOR}.use_dynamic_bsz", "form micro-batches by token count")
    ppo_max_token_len_per_gpu: int = field_(32768, "tokens per training micro-batch with dynamic batch size")
    forward_max_token_len_per_gpu: int = follow(
        ".ppo_max_token_len_per_gpu", "tokens per value-forward micro-batch with dynamic batch size")
    ulysses_sequence_parallel_size: int = field_(1, "Ulysses sequence parallel size (FSDP)")
    ppo_epochs: int = follow(f"{_ACTOR}.ppo_epochs", "passes over each batch of rollouts")
    shuffle: bool = follow(f"{_ACTOR}.shuffle", "shuffle the batch before splitting it into mini-batches")
    grad_clip: float = field_(1.0, "gradients are rescaled so that their global L2 norm is at most this")
    cliprange_value: float = field_(0.5, "new values are clipped to old value ± this in the value loss")
    loss_agg_mode: LossAggMode = follow(f"{_ACTOR}.loss_agg_mode", "how the token losses are reduced to one number")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what the critic's checkpoint holds")
