"""Checks an NLA command makes when it starts, before any work: those that need the model or the data.

Loading checked the configuration alone (ember/config/nla_rules.py); here the model's
config.json says how many layers there are, so a layer index outside the model is named
with the model's layer count, the tokenizer must give a marker and the one the data files
recorded, and the data's recorded `activation_layer` must be the layer the critic predicts. `nla_run_notes` are the lines a run logs once about keys that
mean something else in ember than in the fork.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from transformers import AutoConfig, AutoTokenizer

from ember.config.errors import ConfigError
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLA_ROLLOUT_NAME, NLATrainConfig
from ember.nla.data import activation_layers, model_hidden_size
from ember.nla.eval import eval_sets
from ember.models.reconstructor import full_layer_count
from ember.nla.marker import check_recorded_marker, choose_marker

logger = logging.getLogger(__name__)

CRITIC_PROMPT_MAX_TOKENS = 128  # the fork's limit on critic.critic_prompt


def model_layer_count(path: str, trust_remote_code: bool = False) -> int:
    """Decoder layers of the model at `path` (its config.json; the text model's, for a multimodal one); for a
    reconstructor exported after a cut, the layers of the model it was cut from (hidden_states indices keep
    their meaning)."""
    return model_layer_counts(path, trust_remote_code)[0]


def model_layer_counts(path: str, trust_remote_code: bool = False) -> tuple[int, int]:
    """(decoder layers of the full model, decoder layers the folder holds): equal unless it is a cut reconstructor."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    return full_layer_count(config), config.num_hidden_layers


def check_kept_layer(key: str, layer: int, full: int, kept: int, model: str) -> None:
    """A critic that keeps only its first `kept` of `full` decoder layers can read hidden_states[0..kept] only."""
    if kept < full and layer > kept:
        raise ConfigError(f"{key} reads hidden_states[{layer}], but the critic keeps only its first {kept} of {full} "
                          f"decoder layers ({model}, or truncate_at_layer); use an index of at most {kept}")


def resolve_layer_index(key: str, index: int | None, num_layers: int, model: str) -> int:
    """`index` as a non-negative hidden_states index (null and -1 = the last, num_layers); outside the model
    it stops the run naming the model's layer count."""
    if index is None:
        return num_layers
    if not -(num_layers + 1) <= index <= num_layers:
        raise ConfigError(f"{key}={index} is outside the model: {model} has {num_layers} decoder layers, so "
                          f"hidden_states indices run 0..{num_layers} (0 = the embeddings, {num_layers} = the last "
                          f"layer's output) or -{num_layers + 1}..-1 counted from the end")
    return index % (num_layers + 1)


def check_trained_layer(key: str, layer: int) -> None:
    """A trained critic must read a decoder layer's output: hidden_states[0] is the embeddings' output, where its
    loss reaches no FSDP2 unit's output, so FSDP2 would never reduce (and the optimizer never see) a gradient."""
    if layer == 0:
        raise ConfigError(f"{key} reads hidden_states[0], the embeddings' output, which ember cannot train a critic on "
                          "(no decoder layer's output is on its loss path); read a decoder layer's output, 1 or more")


def check_truncation(key: str, keep: int | None, num_layers: int, model: str) -> None:
    """A truncated model keeps its first `keep` decoder layers, so `keep` must not exceed the model's count."""
    if keep is not None and keep > num_layers:
        raise ConfigError(f"{key}={keep} is outside the model: {model} has {num_layers} decoder layers; "
                          f"keep at most {num_layers}, or null for the full model")


def check_vector_layer(files_key: str, files: str | list[str], layer: int, layer_key: str) -> None:
    """The layer the data's vectors were read from (`activation_layer`, where recorded) must be the one the critic
    predicts: a mismatch trains the critic to rebuild a vector of another layer, which the fork never notices."""
    recorded = activation_layers(files)
    if recorded and recorded != {layer}:
        raise ConfigError(f"{files_key} holds vectors of layer {', '.join(map(str, sorted(recorded)))} "
                          f"(their activation_layer column), but {layer_key} predicts hidden_states[{layer}]; "
                          "extract the data at the critic's layer or set the critic's layer to the data's")


def check_critic_prompt(text: str | None, tokenizer_path: str, trust_remote_code: bool) -> None:
    if text is None:
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    count = len(tokenizer.encode(text, add_special_tokens=False))
    if count > CRITIC_PROMPT_MAX_TOKENS:
        raise ConfigError(f"critic.critic_prompt is {count} tokens long; the critic takes at most "
                          f"{CRITIC_PROMPT_MAX_TOKENS} (as in the fork): shorten it")


def check_data_markers(files: str | list[str] | None, tokenizer_path: str, injection_token: str | None,
                       trust_remote_code: bool) -> None:
    """The tokenizer gives a marker, and every data file that records one (ember's) recorded that one."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    marker = choose_marker(tokenizer, injection_token)
    for path in _as_list(files):
        check_recorded_marker(path, marker)


def check_nla_train_start(cfg: NLATrainConfig) -> None:
    """Everything `ember nla train` checks before it builds anything: paths, the marker against the data, then the
    critic's layers against its model and the data (each row's vector length is checked as the data is read)."""
    from ember.trainer.rl_setup import check_data_files, check_input_paths  # torch-heavy: only when a run starts

    check_input_paths(cfg)
    evaluation = cfg.nla_eval
    sets = eval_sets(evaluation.eval_files, evaluation.eval_file) if evaluation.enabled else {}
    for name, path in sets.items():
        check_data_files(f"nla_eval.eval_files.{name}", path)
    model = cfg.actor_rollout_ref.model
    data_files = [*_as_list(cfg.data.train_files), *_as_list(cfg.data.val_files), *sets.values()]
    check_data_markers(data_files, cfg.data.tokenizer or model.tokenizer_path or model.path,
                       cfg.nla.injection.injection_token, model.trust_remote_code)
    critic = cfg.critic
    num_layers, kept = model_layer_counts(critic.model.path, critic.model.trust_remote_code)
    check_truncation("critic.model.truncate_at_layer", critic.model.truncate_at_layer, kept, critic.model.path)
    layer = resolve_layer_index("critic.output_layer_index", critic.output_layer_index, num_layers, critic.model.path)
    check_trained_layer("critic.output_layer_index", layer)
    check_kept_layer("critic.output_layer_index", layer, num_layers,
                     min(kept, critic.model.truncate_at_layer or kept), critic.model.path)
    actor_size = model_hidden_size(model.path, model.trust_remote_code)
    critic_size = model_hidden_size(critic.model.path, critic.model.trust_remote_code)
    if actor_size != critic_size:
        raise ConfigError(f"the critic's hidden size is {critic_size} ({critic.model.path}) and the actor's {actor_size} "
                          f"({model.path}): the critic predicts the vectors the actor reads, so both must come from "
                          "models of one hidden size")
    check_vector_layer("data.train_files", cfg.data.train_files, layer, "critic.output_layer_index")
    if cfg.data.val_files is not None:
        check_vector_layer("data.val_files", cfg.data.val_files, layer, "critic.output_layer_index")
    check_critic_prompt(critic.critic_prompt, critic.model.tokenizer_path or critic.model.path,
                        critic.model.trust_remote_code)


def check_nla_sft_start(cfg: NLASFTConfig) -> None:
    """What `ember nla sft` checks before it builds anything: the model and data paths, and in critic mode the
    critic's layers against its model and the data."""
    from ember.trainer.rl_setup import check_data_files, check_model_path, check_output_dir

    if cfg.model.partial_pretrain is None:
        raise ConfigError("model.partial_pretrain is not set; point it at the HF model folder (or hub id) to fine-tune")
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is not set; give the NLA SFT parquet file(s) (`ember nla extract` with mode: sft)")
    check_model_path("model.partial_pretrain", cfg.model.partial_pretrain)
    check_data_files("data.train_files", cfg.data.train_files)
    check_data_files("data.val_files", cfg.data.val_files)
    check_output_dir("trainer.default_local_dir", cfg.trainer.default_local_dir)
    if cfg.trainer.default_hdfs_dir:
        check_output_dir("trainer.default_hdfs_dir", cfg.trainer.default_hdfs_dir)
    check_data_markers([*_as_list(cfg.data.train_files), *_as_list(cfg.data.val_files)],
                       cfg.model.tokenizer_path or cfg.model.partial_pretrain, cfg.nla.injection.injection_token,
                       cfg.model.trust_remote_code)
    if cfg.nla.train_mode != "critic":
        return
    critic = cfg.nla.critic
    path = critic.model_path or cfg.model.partial_pretrain
    check_model_path("nla.critic.model_path", path)
    num_layers, kept = model_layer_counts(path, cfg.model.trust_remote_code)
    keep = critic.truncate_layers if critic.truncate_layers is not None and critic.truncate_layers > 0 else None
    check_truncation("nla.critic.truncate_layers", keep, kept, path)
    layer = resolve_layer_index("nla.critic.output_layer_index", critic.output_layer_index, num_layers, path)
    check_trained_layer("nla.critic.output_layer_index", layer)
    check_kept_layer("nla.critic.output_layer_index", layer, num_layers, min(kept, keep or kept), path)
    check_vector_layer("data.train_files", cfg.data.train_files, layer, "nla.critic.output_layer_index")


def _as_list(files: str | list[str] | None) -> list[str]:
    return [files] if isinstance(files, str) else list(files or [])


def nla_run_notes(cfg: NLATrainConfig) -> list[str]:
    """What a run says once about the fork's keys that mean something else in ember."""
    notes = []
    if cfg.actor_rollout_ref.rollout.name == NLA_ROLLOUT_NAME:
        notes.append(f"actor_rollout_ref.rollout.name={NLA_ROLLOUT_NAME}: ember generates with its own engine, the "
                     "vector written over the marker's input embedding in the engine's prefill (no SGLang)")
    sglang = [key for key, value in (("engine_kwargs.sglang", cfg.engine_kwargs.get("sglang")),
                                     ("actor_rollout_ref.rollout.engine_kwargs.sglang",
                                      cfg.actor_rollout_ref.rollout.engine_kwargs.get("sglang"))) if value]
    if sglang:
        notes.append(f"{' and '.join(sglang)}: SGLang's arguments do not apply to ember's engine and are not used")
    return notes


def log_notes(notes: Iterable[str]) -> None:
    for note in notes:
        logger.warning(note)
