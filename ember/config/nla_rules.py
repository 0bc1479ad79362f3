"""What loading does for the NLA configurations beyond ember's own rules: fill, convert, check.

`normalize_nla_train` / `normalize_nla_sft` run after ember's normalisation
(ember/config/normalize.py): under `ember nla train` the actor's and critic's
`ppo_mini_batch_size` count experiences as the fork counts them, and are converted here,
once, to ember's prompts; `fsdp_config: null` beside `strategy: megatron` becomes the
default section; null SFT run names are filled. `nla_train_errors` / `nla_sft_errors` are
the checks the fork makes late (when a worker is built) or never; each message names the
key and what to write instead. Checks that need the model (layer counts) run when a
command starts (ember/nla/checks.py).
"""

from __future__ import annotations

import re
import string

from ember.config.errors import ConfigError
from ember.config.schema.fsdp import FSDPConfig
from ember.config.schema.nla import FORK_SFT_DATASET_MODULE, NLAEvalConfig, NLASection
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig

EVAL_TEMPLATE_FIELDS = ("injection_character", "source_prompt")
RANDOM_VARIANT_SUFFIX = "_random"  # what marks a control data file's name (the fork's rule)


def normalize_nla_train(cfg: NLATrainConfig) -> None:
    """Convert the fork's experience-counted mini-batches to prompts, and null fsdp_config to the default section."""
    trainer, n = cfg.trainer, cfg.actor_rollout_ref.rollout.n
    if trainer.mini_batch_counts == "experiences" and n >= 1:
        for path, section in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
            experiences = section.ppo_mini_batch_size
            if experiences % n:
                raise ConfigError(
                    f"{path}.ppo_mini_batch_size={experiences} counts experiences under ember nla train (prompts × "
                    f"actor_rollout_ref.rollout.n, as the NLA fork counts them), so it must be a multiple of "
                    f"rollout.n={n}; for one update per batch write data.train_batch_size × n = "
                    f"{cfg.data.train_batch_size * n}")
            section.ppo_mini_batch_size = experiences // n
        trainer.mini_batch_counts = "prompts"
    actor = cfg.actor_rollout_ref.actor
    for path, owner, strategy in (("actor_rollout_ref.actor", actor, actor.strategy),
                                  ("critic.model", cfg.critic.model, cfg.critic.strategy)):
        if owner.fsdp_config is None:
            if strategy != "megatron":
                raise ConfigError(f"{path}.fsdp_config=null drops the FSDP settings, which only a Megatron role may do; "
                                  f"its strategy is {strategy}: remove the line, or set the strategy to megatron")
            owner.fsdp_config = FSDPConfig()


def normalize_nla_sft(cfg: NLASFTConfig) -> None:
    """Fill null run names as the fork does: project nla-sft, experiment MODEL-TRAIN_MODE-VARIANT."""
    if cfg.trainer.project_name is None:
        cfg.trainer.project_name = "nla-sft"
    if cfg.trainer.experiment_name is None:
        model = (cfg.model.partial_pretrain or "model").rstrip("/").split("/")[-1]
        slug = re.sub(r"[^a-zA-Z0-9]+", "-", model).strip("-").lower() or "model"
        cfg.trainer.experiment_name = f"{slug}-{cfg.nla.train_mode}-{data_variant(cfg.data.train_files)}"


def data_variant(files: str | list[str] | None) -> str:
    """"random" when a data file is a `_random` control file (vectors moved between rows), else "canonical"."""
    paths = [files] if isinstance(files, str) else list(files or [])
    return "random" if any(RANDOM_VARIANT_SUFFIX in path for path in paths) else "canonical"


def megatron_critic_pipeline_error(cfg: NLATrainConfig) -> str | None:
    """The fork's guard, at load: a pipeline-parallel Megatron critic cannot read an intermediate layer."""
    critic = cfg.critic
    pipeline = critic.megatron.pipeline_model_parallel_size
    if critic.strategy != "megatron" or pipeline <= 1 or critic.output_layer_index in (None, -1):
        return None
    return (f"NLA Megatron critic does not support pipeline parallelism (PP={pipeline}); "
            "set pipeline_model_parallel_size: 1\n"
            f"critic.output_layer_index={critic.output_layer_index} is an intermediate layer, which lives on one pipeline "
            "stage while the prediction is read on the last. Ways out (choose one):\n"
            "  1. critic.megatron.pipeline_model_parallel_size=1: any output_layer_index works\n"
            "  2. critic.output_layer_index=-1: the last layer is on the last stage\n"
            "  3. scale with tensor parallelism instead: raise critic.megatron.tensor_model_parallel_size")


def megatron_reconstructor_layout_error(pipeline_size: int, context_size: int, recompute_granularity: str | None,
                                        reads_final_norm: bool | None) -> str | None:
    """What the reconstructor on strategy megatron does not run (`engines/megatron/reconstructor.py`), checked at
    load and again when the engine is built. `reads_final_norm` None: not known yet (at load, a layer given by
    number may be the last), so full recompute is left to the engine's check."""
    if pipeline_size > 1:
        return (f"critic.megatron.pipeline_model_parallel_size={pipeline_size}: NLA's reconstructor on strategy "
                "megatron runs on one pipeline stage; set it to 1 (use tensor parallelism instead)")
    if context_size > 1:
        return (f"critic.megatron.context_parallel_size={context_size}: NLA's reconstructor reads each sample's last "
                "token, which context parallelism leaves on one rank; set it to 1")
    if recompute_granularity == "full" and reads_final_norm is False:
        return ("critic.megatron.override_transformer_config.recompute_granularity=full recomputes whole decoder "
                "layers, so an inner layer's output (critic.output_layer_index) carries no gradient: use "
                "recompute_granularity=selective, or read the last layer (output_layer_index=-1)")
    return None


def nla_train_errors(cfg: NLATrainConfig) -> list[str]:
    """Every NLA problem of an `ember nla train` configuration but the pipeline guard (raised on its own, first)."""
    errors = _section_errors("nla", cfg.nla)
    critic = cfg.critic
    if critic.critic_prompt is not None and not critic.critic_prompt.strip():
        errors.append("critic.critic_prompt is empty; remove it (the critic then reads the response alone) or give text")
    errors += _truncation_errors("critic.model.truncate_at_layer", critic.model.truncate_at_layer,
                                 "critic.output_layer_index", critic.output_layer_index)
    if critic.strategy == "megatron":
        megatron = critic.megatron
        reads_final_norm = (False if critic.model.truncate_at_layer is not None
                            else True if critic.output_layer_index in (None, -1) else None)
        layout = megatron_reconstructor_layout_error(
            megatron.pipeline_model_parallel_size, megatron.context_parallel_size,
            (megatron.override_transformer_config or {}).get("recompute_granularity"), reads_final_norm)
        errors += [layout] if layout else []
    if not critic.enable:
        errors.append("critic.enable=false: NLA's reward comes from the critic (the reconstructor); remove the line")
    if cfg.algorithm.adv_estimator == "gae":
        errors.append("algorithm.adv_estimator=gae would read the critic as a value function; NLA's critic predicts "
                      "vectors: use grpo (the fork's) or another critic-free estimator")
    errors += _eval_errors(cfg.nla_eval)
    for name in ("ppo_epochs", "steps_per_update", "ppo_mini_batch_size"):
        value = getattr(cfg.trainer, name)
        if value is not None and value < 1:
            errors.append(f"trainer.{name}={value} is out of range: it must be at least 1")
    return errors


def nla_sft_errors(cfg: NLASFTConfig) -> list[str]:
    """Every NLA problem of an `ember nla sft` configuration."""
    errors = _section_errors("nla", cfg.nla)
    critic = cfg.nla.critic
    trains_critic = cfg.nla.train_mode == "critic"  # actor mode reads none of the critic's keys (nor does the fork)
    if trains_critic and critic.truncate_layers is not None and critic.truncate_layers > 0:
        errors += _truncation_errors("nla.critic.truncate_layers", critic.truncate_layers,
                                     "nla.critic.output_layer_index", critic.output_layer_index)
    if cfg.model.truncate_layers is not None:
        errors.append(f"model.truncate_layers={cfg.model.truncate_layers}: the actor is always the full model; "
                      "remove the line (nla.critic.truncate_layers truncates the critic)")
    if cfg.data.custom_cls.path not in (None, FORK_SFT_DATASET_MODULE):
        errors.append(f"data.custom_cls.path={cfg.data.custom_cls.path}: ember nla sft reads NLA rows itself "
                      "(ember/nla/data.py); remove data.custom_cls")
    for name in ("critic_lr", "critic_epochs") if trains_critic else ():
        value = getattr(cfg.nla, name)
        if value is not None and value <= 0:
            errors.append(f"nla.{name}={value} is out of range: it must be greater than 0 (or null)")
    return errors


def _section_errors(path: str, nla: NLASection) -> list[str]:
    injection = nla.injection
    errors = []
    if injection.layer_indices != [0]:
        errors.append(f"{path}.injection.layer_indices={injection.layer_indices}: only [0] (the input embeddings) is "
                      "supported, in the fork as in ember")
    if injection.projection_dim is not None and injection.mode != "project":
        errors.append(f"{path}.injection.projection_dim={injection.projection_dim} is used by mode project only; "
                      f"remove it or set {path}.injection.mode=project")
    if injection.projection_dim is not None and injection.projection_dim < 1:
        errors.append(f"{path}.injection.projection_dim={injection.projection_dim} must be at least 1 (or null)")
    if injection.injection_token is not None and len(injection.injection_token) != 1:
        errors.append(f"{path}.injection.injection_token={injection.injection_token!r} must be one character "
                      "(the marker the tokenizer keeps as one token), or null to let ember choose")
    if nla.scale is not None and nla.scale <= 0:
        errors.append(f"{path}.scale={nla.scale} must be greater than 0 (or null for vectors as stored)")
    if not nla.activation_vector_key:
        errors.append(f"{path}.activation_vector_key is empty; name the column holding the vectors")
    return errors


def _truncation_errors(truncate_key: str, truncate: int | None, index_key: str, index: int | None) -> list[str]:
    """A truncated critic keeps layers 1..truncate, so the prediction must name a layer it still has."""
    if truncate is None:
        return []
    if truncate < 1:
        return [f"{truncate_key}={truncate} keeps no layer; give at least 1, or null for the full model"]
    if index is None or not 0 <= index <= truncate:
        return [f"{truncate_key}={truncate} keeps decoder layers 1..{truncate}, so {index_key} must name one of "
                f"hidden_states 0..{truncate}; it is {index} (null and negative indices mean the full model's last layer)"]
    return []


def _eval_errors(evaluation: NLAEvalConfig) -> list[str]:
    if not evaluation.enabled:
        return []
    errors = []
    if not evaluation.eval_files and evaluation.eval_file is None:
        errors.append("nla_eval.enabled=true needs nla_eval.eval_files ({NAME: parquet}) or nla_eval.eval_file")
    if evaluation.eval_files and evaluation.eval_file is not None:
        errors.append("nla_eval.eval_files and nla_eval.eval_file are both set (the fork silently uses eval_files); "
                      "remove one")
    for name in ("freq", "max_new_tokens", "num_generations_per_prompt", "max_samples"):
        value = getattr(evaluation, name)
        if value is not None and value < 1:
            errors.append(f"nla_eval.{name}={value} is out of range: it must be at least 1")
    if evaluation.temperature < 0:
        errors.append(f"nla_eval.temperature={evaluation.temperature} is out of range: it must be at least 0")
    template_errors = _template_errors("nla_eval.template", evaluation.template, EVAL_TEMPLATE_FIELDS)
    if not template_errors and _template_fields(evaluation.template).count("injection_character") != 1:
        template_errors.append("nla_eval.template must hold {injection_character} exactly once: it is where the vector goes")
    return errors + template_errors


def nla_extract_errors(cfg: NLAExtractConfig) -> list[str]:
    """Every problem of an `ember nla extract` configuration that shows without reading the model or the documents."""
    errors = []
    dataset, sampling = cfg.dataset, cfg.sampling
    if (dataset.text_column is None) == (dataset.chat_column is None):
        errors.append("name the documents' column: dataset.text_column (plain text) or dataset.chat_column (chats), "
                      "one of them")
    if cfg.mode == "eval" and dataset.text_column is None:
        errors.append("mode eval reads each row's source_prompt as plain text: set dataset.text_column to its column")
    if dataset.expect_chat and dataset.chat_column is None:
        errors.append("dataset.expect_chat=true needs dataset.chat_column (the column of chats)")
    for key, value, low in (("sampling.activations_per_sample", sampling.activations_per_sample, 1),
                            ("sampling.total_activations", sampling.total_activations, 1),
                            ("sampling.max_length", sampling.max_length, 2),
                            ("sampling.parallel_batch_size", sampling.parallel_batch_size, 1),
                            ("dataset.max_samples", dataset.max_samples, 1),
                            ("dataset.slice_start", dataset.slice_start, 0),
                            ("dataset.slice_length", dataset.slice_length, 1),
                            ("response.summarizer.max_new_tokens", cfg.response.summarizer.max_new_tokens, 1)):
        if value is not None and value < low:
            errors.append(f"{key}={value} is out of range: it must be at least {low}")
    if cfg.response.summarizer.temperature < 0:
        errors.append(f"response.summarizer.temperature={cfg.response.summarizer.temperature} must be at least 0")
    errors += _prompt_message_errors(cfg.prompt.messages)
    errors += _template_errors("response.template", cfg.response.template, RESPONSE_TEMPLATE_FIELDS)
    errors += _template_errors("response.summarizer.prompt", cfg.response.summarizer.prompt, ("source",))
    variant = cfg.output.random_variant
    if variant.columns is not None and not variant.columns:
        errors.append("output.random_variant.columns is empty; list the columns to move between rows, or null")
    if cfg.output.injection_token is not None and len(cfg.output.injection_token) != 1:
        errors.append(f"output.injection_token={cfg.output.injection_token!r} must be one character, or null")
    return errors


RESPONSE_TEMPLATE_FIELDS = ("processed_response", "response", "source")


def _template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def _template_errors(key: str, template: str, allowed: tuple[str, ...]) -> list[str]:
    try:
        fields = _template_fields(template)
    except ValueError as error:
        return [f"{key} cannot be read as a format string ({error}); write literal braces as {{{{ }}}}"]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        return [f"{key} uses {', '.join('{' + name + '}' for name in unknown)}; it may use "
                + ", ".join("{" + name + "}" for name in allowed)]
    return []


def _prompt_message_errors(messages: list[dict[str, str]]) -> list[str]:
    errors, markers = [], 0
    for index, message in enumerate(messages):
        key = f"prompt.messages[{index}]"
        if not set(message) <= {"role", "template"} or not isinstance(message.get("template"), str):
            errors.append(f"{key}={message!r} must be a mapping of template (text) and optionally role")
            continue
        template_errors = _template_errors(f"{key}.template", message["template"], ("injection_token",))
        errors += template_errors
        if not template_errors:
            markers += _template_fields(message["template"]).count("injection_token")
    if not errors and markers != 1:
        errors.append(f"prompt.messages hold {{injection_token}} {markers} times; write it exactly once: it is where "
                      "the vector goes")
    return errors
