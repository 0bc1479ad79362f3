"""`NLASFTConfig`, the configuration of `ember nla sft`: ember's SFT schema plus the NLA fork's SFT keys.

The fork's SFT files (`defaults: [/sft_trainer, _self_]`, e.g. its nla_sft_7b_8gpu.yaml)
load as written. `nla.train_mode` picks what is trained from the same SFT parquet: the actor
(cross-entropy on `response` with the vector injected at the prompt's marker) or the critic
(MSE of the vector predicted from `response`). Both write HF folders that `ember nla train`
takes as `actor_rollout_ref.model.path` and `critic.model.path`.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from ember.config.schema.actor import CheckpointConfig
from ember.config.schema.base import field_, section
from ember.config.schema.nla import NLASFTSection
from ember.config.schema.sft import SFTConfig, SFTDataConfig, SFTModelConfig, SFTTrainerConfig
from ember.config.verl_keys import VerlKey


@dataclass
class NLASFTDataConfig(SFTDataConfig):
    """SFT rows of NLA: `prompt` (chat messages holding the marker), `response` and the vector."""

    prompt_key: str = field_("prompt", "column holding the prompt (chat messages with the marker in the user turn)")
    response_key: str = field_("response", "column holding the explanation the actor learns to write")
    use_shm: bool = field_(False, "verl: copy files to shared memory first; ember reads them in place (no effect)")


@dataclass
class NLASFTModelConfig(SFTModelConfig):
    """The actor being fine-tuned (the critic's model is nla.critic.model_path)."""

    truncate_layers: int | None = field_(None, "the fork's truncation switch for the actor; null = full model (only null)")


@dataclass
class NLASFTTrainerConfig(SFTTrainerConfig):
    """The run; null names are filled from the model, nla.train_mode and the data variant, as the fork does."""

    project_name: str | None = field_("nla-sft", "project the run belongs to; null = nla-sft")
    experiment_name: str | None = field_(
        None, "name of this run; null = MODEL-TRAIN_MODE-VARIANT (canonical, or random for a _random data file)")
    default_local_dir: str = field_(
        "checkpoints/nla_sft/${nla.train_mode}", "where checkpoints and the resolved config are written")
    disable_checkpointing: bool = field_(False, "write no checkpoint at all, not even the last (the final HF "
                                                "folder is still written)")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what a checkpoint holds (hf_model: the folder RL starts from)")


@dataclass
class NLASFTConfig(SFTConfig):
    """Everything `ember nla sft` needs."""

    builtin_bases: ClassVar[dict[str, dict[str, Any]]] = SFTConfig.builtin_bases
    key_aliases: ClassVar[dict[str, str]] = SFTConfig.key_aliases
    verl_keys: ClassVar[dict[str, VerlKey]] = SFTConfig.verl_keys

    data: NLASFTDataConfig = section(NLASFTDataConfig, "NLA SFT rows and batch size")
    model: NLASFTModelConfig = section(NLASFTModelConfig, "the actor being fine-tuned")
    trainer: NLASFTTrainerConfig = section(NLASFTTrainerConfig, "the run: GPUs, logging, checkpoints")
    nla: NLASFTSection = section(NLASFTSection, "what is trained, and how the vector enters")
    engine: dict[str, Any] = field_({}, "the fork's engine block (engine.strategy); read by nothing (model.strategy decides)")
