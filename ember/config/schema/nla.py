"""Natural Language Autoencoders (NLA): the `nla` and `nla_eval` sections, in the keys of the public verl NLA fork.

The actor (verbaliser) reads a prompt whose marker token's input embedding is replaced by an
activation vector and explains it in words; the critic (reconstructor) reads only the
explanation and predicts the vector; the actor's reward is how close the prediction is.
Keys and defaults are the fork's (docs/nla.md); ember's own additions (`scale`/`norm` in RL,
`normalized_reward`) are off by default. Keys the fork's base file carries but nothing in
the fork reads are accepted and say so.
"""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_, section

InjectionMode = Literal["replace", "add", "project"]
MarkerPosition = Literal["manual", "start", "end"]
VectorNorm = Literal["unit"]
NLATrainMode = Literal["actor", "critic"]

DEFAULT_EVAL_TEMPLATE = "Explain the following: <concept>{injection_character}</concept>\n"
FORK_SFT_DATASET_MODULE = "verl.nla.data.nla_sft_dataset"  # what the fork's SFT files name in data.custom_cls.path


@dataclass
class NLAInjectionConfig:
    """Where and how the activation vector enters the actor."""

    mode: InjectionMode = field_(
        "replace", "replace: the vector replaces the marker's input embedding (the fork); add: it is added to it; "
        "project: a learned linear map of the vector replaces it (the fork computes the map but injects nothing)")
    layer_indices: list[int] = field_(
        [0], "where the vector enters: [0] = the output of the input embeddings, the only value the fork and ember support")
    projection_dim: int | None = field_(
        None, "output size of the projection of mode project: null or the actor's hidden size")
    injection_token: str | None = field_(
        None, "the marker character; null = the first of the rare characters in ember/nla/marker.py that the "
        "tokenizer keeps as one token and decodes back")
    position: MarkerPosition = field_(
        "manual", "manual: every prompt already holds <concept>MARKER</concept>; start / end: ember writes it at the "
        "start / end of the last user turn of prompts that lack it (the fork inserts the bare token id)")


@dataclass
class NLASection:
    """What `ember nla train` and `ember nla sft` both read from `nla`."""

    injection: NLAInjectionConfig = section(NLAInjectionConfig, "how the vector enters the actor")
    activation_vector_key: str = field_("activation_vector", "column holding each row's activation vector")
    scale: float | None = field_(
        None, "multiply every vector by this as it is read, after norm (the fork's SFT; ember applies it in RL too); "
        "null = as stored")
    norm: VectorNorm | None = field_(
        None, "unit: divide every vector by its L2 norm as it is read (the fork's SFT; ember applies it in RL too); "
        "null = as stored")


@dataclass
class NLARLSection(NLASection):
    """`nla` of `ember nla train`: the shared keys, ember's reward option and the fork's unread keys."""

    normalized_reward: bool = field_(
        False, "ember's: reward = -MSE / mean(target²) of each sample (scale-free across layers and models) "
        "instead of the fork's -MSE; GRPO's per-group normalisation follows either way")
    fork_actor_gradient_scale: bool = field_(
        False, "ember's: scale the actor's loss by 1/rollout.n as the fork's runs do (verl multiplies its "
        "experience-counted ppo_mini_batch_size by n again), so grad norms and grad_clip match the fork's curves; "
        "false = the true mean over the mini-batch")
    activation_dim: int | None = field_(None, "the fork's base file; read by nothing (the model's hidden size decides)")
    injection_position: str = field_("manual", "the fork's base file; read by nothing (nla.injection.position decides)")
    injection_mode: str = field_("replace", "the fork's base file; read by nothing (nla.injection.mode decides)")
    injection_layer_indices: list[int] = field_(
        [0], "the fork's base file; read by nothing (nla.injection.layer_indices decides)")


@dataclass
class NLASFTCriticConfig:
    """`nla.critic` of an NLA SFT run: the reconstructor trained with `nla.train_mode=critic`."""

    model_path: str | None = field_(None, "HF model the critic starts from; null = model.partial_pretrain")
    output_layer_index: int | None = field_(
        None, "hidden_states index the critic predicts the vector from (0 = embeddings, L = output of layer L); "
        "null or -1 = the last")
    truncate_layers: int | None = field_(
        None, "keep only the first this many decoder layers of the critic; null or <= 0 = all")
    pooling: Literal["last"] = field_("last", "which response token the prediction is read at: last")
    dropout: float = field_(0.1, "the fork's value-head dropout; ember's critic has no head (no effect)")
    projection_layers: int | None = field_(None, "the fork's value-head depth; ember's critic has no head (no effect)")


@dataclass
class NLASFTSection(NLASection):
    """`nla` of `ember nla sft`."""

    train_mode: NLATrainMode = field_(
        "actor", "actor: cross-entropy on the response with the vector injected; critic: MSE of the vector "
        "predicted from the response text")
    critic: NLASFTCriticConfig = section(NLASFTCriticConfig, "the critic of nla.train_mode=critic")
    critic_lr: float | None = field_(None, "learning rate of critic SFT; null = optim.lr")
    critic_epochs: int | None = field_(None, "passes over the data in critic SFT; null = trainer.total_epochs")


@dataclass
class NLAEvalConfig:
    """The fork's string-match evaluation: does the explanation of a known vector name the expected word?"""

    enabled: bool = field_(False, "run the evaluation (at step 1, every freq steps and at the last step of ember nla train)")
    eval_files: dict[str, str] = field_(
        {}, "evaluation sets {NAME: parquet path}, each reported as nla_eval/NAME/...; rows hold source_prompt, "
        "activation_vector, expected_completions, description")
    eval_file: str | None = field_(None, "one evaluation set (reported as nla_eval/default/...) when eval_files is empty")
    freq: int = field_(100, "evaluate every this many training steps")
    max_samples: int | None = field_(None, "evaluate only the first this many rows of each set; null = all")
    max_new_tokens: int = field_(50, "most tokens generated per explanation")
    temperature: float = field_(0.7, "sampling temperature of the explanations")
    do_sample: bool = field_(True, "sample the explanations; false = greedy")
    num_generations_per_prompt: int = field_(
        1, "explanations per row; a row scores the fraction of them that name an expected string")
    template: str = field_(
        DEFAULT_EVAL_TEMPLATE, "the user turn of every evaluation prompt: {injection_character} is the marker, "
        "{source_prompt} the row's source_prompt")
