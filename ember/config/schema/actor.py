"""The actor: the policy being trained (`actor_rollout_ref.actor`), with its loss, batching and backend.

Batch sizes count prompts before `rollout.n` repeats them, as in verl: one optimizer step
uses `ppo_mini_batch_size × rollout.n` responses, split evenly over the data-parallel ranks
and then into micro-batches of `ppo_micro_batch_size_per_gpu`.
"""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import Strategy, field_, follow, section
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.megatron import MegatronConfig
from ember.config.schema.optim import OptimConfig

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PolicyLossMode = Literal["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]


@dataclass
class PolicyLossConfig:
    """Which policy-gradient loss the actor minimises, and the knobs of the clip_cov / kl_cov losses."""

    loss_mode: PolicyLossMode = field_(
        "vanilla", "policy loss: vanilla (PPO clip), gspo (sequence-level ratio), gpg, clip_cov, kl_cov, geo_mean")
    clip_cov_ratio: float = field_(0.0002, "fraction of tokens clipped by clip_cov")
    clip_cov_lb: float = field_(1.0, "lower bound of the covariance window of clip_cov")
    clip_cov_ub: float = field_(5.0, "upper bound of the covariance window of clip_cov")
    kl_cov_ratio: float = field_(0.0002, "fraction of tokens given a KL penalty by kl_cov")
    ppo_kl_coef: float = field_(0.1, "coefficient of the KL penalty of kl_cov")


@dataclass
class CheckpointConfig:
    """What a role's checkpoint holds."""

    save_contents: list[CheckpointContent] = field_(
        ["model", "optimizer", "extra"], "what is saved: model (sharded), optimizer and extra (scheduler, RNG) are "
        "always saved, so every checkpoint resumes exactly; hf_model adds a folder transformers loads "
        "(<role>/huggingface in each global_step_N)")
    load_contents: list[CheckpointContent] = follow(".save_contents", "what is restored when resuming; ember restores "
                                                    "everything a checkpoint holds (no effect)")


@dataclass
class ActorConfig:
    """The trained policy: backend, PPO batching, loss and optimizer."""

    strategy: Strategy = field_("fsdp", "training backend: fsdp / fsdp2 (ember's FSDP2 engine) or megatron")
    ppo_mini_batch_size: int = field_(256, "prompts per optimizer step (each with rollout.n responses)")
    ppo_micro_batch_size: int | None = field_(
        None, "deprecated: micro-batch over all GPUs; use ppo_micro_batch_size_per_gpu")
    ppo_micro_batch_size_per_gpu: int | None = field_(
        None, "responses per forward/backward on one GPU; null = the whole per-GPU mini-batch")
    use_dynamic_bsz: bool = field_(
        False, "form micro-batches by token count (ppo_max_token_len_per_gpu) instead of sample count")
    ppo_max_token_len_per_gpu: int = field_(16384, "tokens per micro-batch on one GPU when use_dynamic_bsz is true")
    grad_clip: float = field_(1.0, "gradients are rescaled so that their global L2 norm is at most this")
    clip_ratio: float = field_(0.2, "PPO clip range ε: the ratio is clipped to [1 - ε, 1 + ε]")
    clip_ratio_low: float = follow(".clip_ratio", "lower clip range (ratio >= 1 - clip_ratio_low)")
    clip_ratio_high: float = follow(".clip_ratio", "upper clip range (ratio <= 1 + clip_ratio_high; DAPO's clip-higher)")
    clip_ratio_c: float = field_(3.0, "dual-clip bound on the loss of negative-advantage tokens (must be > 1)")
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "policy loss choice and its parameters")
    loss_agg_mode: LossAggMode = field_("token-mean", "how the token losses of a batch are reduced to one number")
    loss_scale_factor: float | None = field_(
        None, "the constant each sequence's token sum is divided by under loss_agg_mode=seq-mean-token-sum-norm "
              "(null: data.max_response_length, the padded response length)")
    entropy_coeff: float = field_(0.0, "weight of the entropy bonus in the actor loss")
    use_kl_loss: bool = field_(False, "add a KL(actor ‖ reference) term to the actor loss (GRPO style)")
    kl_loss_coef: float = field_(0.001, "weight of the KL loss term")
    kl_loss_type: KLEstimator = field_(
        "low_var_kl", "KL estimator of the KL loss; a trailing + uses the k2 gradient (straight-through)")
    use_torch_compile: bool = field_(
        False, "torch.compile each decoder layer's forward (actor and reference) on an accelerator; ignored on CPU")
    ppo_epochs: int = field_(1, "passes over each batch of rollouts")
    shuffle: bool = field_(False, "shuffle the batch before splitting it into mini-batches")
    ulysses_sequence_parallel_size: int = field_(
        1, "Ulysses sequence parallel size (FSDP): each sequence is split over this many GPUs")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what the actor's checkpoint holds")
    optim: OptimConfig = section(OptimConfig, "optimizer and learning-rate schedule")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offloading (strategy fsdp / fsdp2)")
    megatron: MegatronConfig = section(MegatronConfig, "Megatron parallel layout and offloading (strategy megatron)")
