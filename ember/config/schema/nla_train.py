"""`NLATrainConfig`, the configuration of `ember nla train` and `ember nla eval`: ember's RL schema plus the NLA fork's keys.

Run files in the fork's form load as written: `defaults: [/nla_grpo_full, _self_]` names
ember's own copy of the fork's base (`ember/config/bases/nla_grpo_full.yaml`), and
`actor_rollout_ref.nla: ${nla}` hands the `nla` section to the workers. The one thing to
know: under `ember nla train`, `ppo_mini_batch_size` counts experiences (prompts ×
rollout.n, so train_batch_size × n is one update per batch), as in the fork;
`trainer.mini_batch_counts` says so, and loading converts it once to ember's prompts
(ember/config/normalize.py).
"""

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal

from ember.config.schema.actor import ActorConfig
from ember.config.schema.base import field_, follow, section
from ember.config.schema.critic import CriticConfig, CriticModelConfig
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.nla import NLAEvalConfig, NLARLSection
from ember.config.schema.root import ActorRolloutRefConfig, EmberConfig
from ember.config.schema.rollout import RolloutConfig
from ember.config.schema.trainer import TrainerConfig
from ember.config.verl_keys import NLA_FORK_KEYS, VerlKey
from ember.config.yaml_io import read_yaml_file

NLA_ROLLOUT_NAME = "nla_sglang"  # the fork's SGLang-with-input-embeddings; in ember, ember's own engine
BASES_DIR = Path(__file__).resolve().parent.parent / "bases"

MiniBatchUnit = Literal["experiences", "prompts"]


@dataclass
class NLAActorConfig(ActorConfig):
    """The actor; `fsdp_config: null` is how the fork's Megatron files drop the FSDP settings."""

    fsdp_config: FSDPConfig | None = section(
        FSDPConfig, "FSDP sharding and offloading; null (beside strategy megatron) = none")


@dataclass
class NLARolloutConfig(RolloutConfig):
    """Rollout, with the fork's engine name and SGLang's prefix-cache switch."""

    name: Literal["ember", "hf", "vllm", "sglang", "nla_sglang"] = field_(
        "ember", "generation engine; nla_sglang (the fork's SGLang fed input embeddings) means ember's own engine "
        "with the vector injected at the marker")
    @property
    def engine(self) -> str:
        """nla_sglang runs on ember's own engine (the vector injected in its prefill)."""
        return "ember" if self.name == NLA_ROLLOUT_NAME else super().engine

    disable_radix_cache: bool = field_(
        False, "SGLang's cross-request prefix cache; ember's engine shares a prompt's prefill only among its own "
        "rollout.n samples, which carry the same vector (no effect)")


@dataclass
class NLAActorRolloutRefConfig(ActorRolloutRefConfig):
    """The policy's roles, with the `nla` section they read (`actor_rollout_ref.nla: ${nla}`)."""

    actor: NLAActorConfig = section(NLAActorConfig, "the trained policy (the verbaliser)")
    rollout: NLARolloutConfig = section(NLARolloutConfig, "response generation")
    nla: NLARLSection = follow("nla", "the nla section as the actor and rollout see it")


@dataclass
class NLACriticModelConfig(CriticModelConfig):
    """The reconstructor's model: the full base model, or its first layers."""

    fsdp_config: FSDPConfig | None = section(
        FSDPConfig, "FSDP sharding and offloading of the critic; null (beside strategy megatron) = none")
    truncate_at_layer: int | None = field_(
        None, "keep only decoder layers 1..N of the critic (the prediction must come from hidden_states index <= N); "
        "null = all (the fork refuses any other value)")


@dataclass
class NLACriticConfig(CriticConfig):
    """The reconstructor: predicts the vector from the explanation alone."""

    enable: bool | None = field_(True, "train the reconstructor (NLA always has one)")
    model: NLACriticModelConfig = section(NLACriticModelConfig, "the reconstructor's model")
    output_layer_index: int | None = field_(
        None, "hidden_states index the vector is predicted from (transformers' indexing: 0 = embeddings, L = output "
        "of decoder layer L, before the final norm); null or -1 = the last")
    critic_prompt: str | None = field_(
        None, "text put before the response tokens the critic reads (at most 128 tokens); null = the response alone")
    pooling_strategy: Literal["last"] = field_(
        "last", "response token the prediction is read at: last (EOS included), the only one the fork's reward uses")


@dataclass
class NLATrainerConfig(TrainerConfig):
    """The run, with the fork's mirrors of the batching keys."""

    mini_batch_counts: MiniBatchUnit = field_(
        "experiences", "what actor/critic ppo_mini_batch_size count: experiences (the fork's meaning: prompts × "
        "rollout.n, so train_batch_size × n = one update per batch) or prompts (ember's); loading converts "
        "experiences to prompts once and sets this to prompts")
    ppo_mini_batch_size: int | None = field_(
        None, "the fork's mirror of actor.ppo_mini_batch_size; recorded only (the actor's key decides)")
    ppo_epochs: int = field_(1, "the fork's mirror of actor.ppo_epochs; recorded only (the actor's key decides)")
    steps_per_update: int = field_(1, "the fork's; recorded only (one update per step)")


@cache
def _builtin_base(name: str) -> dict[str, Any]:
    return read_yaml_file(str(BASES_DIR / f"{name}.yaml"))


@dataclass
class NLATrainConfig(EmberConfig):
    """Everything `ember nla train` needs: ember's RL configuration and NLA's sections."""

    builtin_bases: ClassVar[dict[str, dict[str, Any]]] = {
        **EmberConfig.builtin_bases,
        "nla_grpo_full": _builtin_base("nla_grpo_full"),
    }
    key_aliases: ClassVar[dict[str, str]] = {
        **EmberConfig.key_aliases,
        "data.batch_size": "data.train_batch_size",  # the fork keeps both, "for compatibility"
    }
    verl_keys: ClassVar[dict[str, VerlKey]] = {**EmberConfig.verl_keys, **NLA_FORK_KEYS}
    implicit_base: ClassVar[str] = "nla_grpo_full"  # what a run file without a defaults list extends

    actor_rollout_ref: NLAActorRolloutRefConfig = section(NLAActorRolloutRefConfig, "the policy (verbaliser)")
    critic: NLACriticConfig = section(NLACriticConfig, "the reconstructor")
    trainer: NLATrainerConfig = section(NLATrainerConfig, "the run: GPUs, logging, checkpoints, validation")
    nla: NLARLSection = section(NLARLSection, "activation vectors and their injection")
    nla_eval: NLAEvalConfig = section(NLAEvalConfig, "the fork's string-match evaluation")
    engine_kwargs: dict[str, Any] = field_(
        {"sglang": {}}, "the fork's top-level SGLang arguments (engine_kwargs.sglang); ember's engine takes none (no effect)")
    grpo: dict[str, Any] = field_({}, "the fork's base file's grpo block; read by nothing (rollout.n and the actor's keys decide)")
