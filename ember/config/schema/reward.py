"""Where rewards come from: a reward model, a user's reward function, and how scoring runs.

Rule-based scoring is chosen per sample by `data.reward_fn_key` (the data source) unless
`custom_reward_function.path` names a file; see `ember/rewards`. The function is called as
`name(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`.
"""

from dataclasses import dataclass
from typing import Any, Literal

from ember.config.schema.base import Strategy, field_, follow, section
from ember.config.schema.fsdp import FSDPConfig

RewardManagerName = Literal["naive", "batch", "prime", "dapo"]

_MODEL = "actor_rollout_ref.model"


@dataclass
class RewardModelModelConfig:
    """The reward model checkpoint and how it reads the policy's responses."""

    input_tokenizer: str | None = follow(
        f"{_MODEL}.path", "tokenizer of the policy, used to decode responses for the reward model")
    path: str | None = field_(None, "HF sequence-classification model directory or hub id")
    external_lib: str | None = field_(None, "Python module imported before loading the model")
    trust_remote_code: bool = field_(False, "allow code shipped with the checkpoint to run")
    use_remove_padding: bool = field_(False, "pack sequences without padding (variable-length attention)")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP sharding and offloading of the reward model")


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (reward_manager=dapo): a linear penalty for responses that run
    into the last `len` tokens before data.max_response_length."""

    enable: bool = field_(False, "subtract the penalty from the reward")
    len: int = field_(0, "tokens before max_response_length where the penalty grows from 0")
    penalty_factor: float = field_(0.0, "penalty at max_response_length (it grows linearly over the buffer)")
    log: bool = field_(False, "also log reward/overlong_reward/mean and reward/overlong/mean (share penalised)")


@dataclass
class RewardModelConfig:
    """Model-based reward and the scoring of rule-based rewards."""

    enable: bool = field_(False, "score responses with a reward model (in addition to the reward function)")
    strategy: Strategy = follow("actor_rollout_ref.actor.strategy", "backend that runs the reward model")
    model: RewardModelModelConfig = section(RewardModelModelConfig, "the reward model")
    micro_batch_size: int | None = field_(None, "deprecated: micro-batch over all GPUs; use micro_batch_size_per_gpu")
    micro_batch_size_per_gpu: int | None = field_(None, "responses per reward-model forward on one GPU")
    max_length: int | None = field_(None, "longest prompt + response the reward model reads; null = no limit")
    use_dynamic_bsz: bool = follow("critic.use_dynamic_bsz", "form micro-batches by token count")
    forward_max_token_len_per_gpu: int = follow(
        "critic.forward_max_token_len_per_gpu", "tokens per micro-batch with dynamic batch size")
    reward_manager: RewardManagerName = field_(
        "naive", "how a batch is scored: naive and prime (one call per sample, in num_workers processes), dapo "
                 "(the same, with overlong_buffer's shaping), batch (one call per batch with lists: fn(data_sources, "
                 "solution_strs, ground_truths, extra_infos) -> list, in the driver, no timeout)")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO's overlong reward shaping")
    launch_reward_fn_async: bool = field_(False, "score the batch while the actor computes log-probs")
    num_workers: int = field_(2, "processes that run the reward function; 0 = in the driver (no timeout)")
    timeout_s: float = field_(10.0, "seconds one reward call may take before it scores failure_score")
    failure_score: float = field_(0.0, "reward of a sample whose reward function raised, crashed or timed out")


@dataclass
class CustomRewardFunctionConfig:
    """A reward function loaded from a user's Python file."""

    path: str | None = field_(
        None, "Python file defining the reward function; null = the built-in scorer of each data source")
    name: str = field_("compute_score", "name of the function in that file")
    reward_kwargs: dict[str, Any] = field_({}, "extra keyword arguments passed to the function")
