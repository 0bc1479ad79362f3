"""Checks across fields that types alone cannot express, run once when a configuration is loaded.

Numbers no range can catch (NaN, infinity, integers past 64 bits, seeds, sizes that cannot be
allocated: `numbers.py`) first and alone; then ranges (sizes >= 1, probabilities in [0, 1]),
batch arithmetic (a step's batch splits into whole mini-batches, a mini-batch's responses
split evenly over data-parallel ranks and then into whole micro-batches), parallel sizes that
divide the GPUs, settings that need another one, and loggers whose optional package is not
installed. All problems are reported together, each naming the keys, their values and what
would be valid.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from ember.config.errors import ConfigError
from ember.config.introspect import value_at
from ember.config.lora_rules import lora_errors
from ember.config.nla_rules import megatron_critic_pipeline_error, nla_extract_errors, nla_sft_errors, nla_train_errors
from ember.config.numbers import number_errors
from ember.config.parallel import data_parallel_size, nearest_divisors, world_size
from ember.config.placement import placement_errors, role_gpus
from ember.config.rollout_correction import parse_rejection
from ember.config.schema import EmberConfig, SFTConfig
from ember.config.schema.async_training import ASYNC_MODES, AsyncTrainingConfig
from ember.config.schema.megatron import MegatronConfig
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig
from ember.config.schema.trainer import LOGGERS_FROM_EXTRAS

_ACTOR = "actor_rollout_ref.actor"
_REF = "actor_rollout_ref.ref"
_ROLLOUT = "actor_rollout_ref.rollout"
_MODEL = "actor_rollout_ref.model"
_POOL_ROLE = {_ACTOR: "actor_rollout", _REF: "ref", "critic": "critic"}  # each section's role in resource_pool
_MEGATRON_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                   "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")


@dataclass(frozen=True)
class Bound:
    """An allowed range for the number at `path`; null values are not checked."""

    path: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the value must be strictly greater than low

    def violated_by(self, value: float) -> bool:
        below = self.low is not None and (value < self.low or (self.low_open and value == self.low))
        return below or (self.high is not None and value > self.high)

    def describe(self) -> str:
        if self.high is not None:
            return f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        return f"must be {'greater than' if self.low_open else 'at least'} {self.low}"


def validate(cfg: Any) -> None:
    """Raise one ConfigError listing every problem of `cfg` (a root configuration), or return if there is none.
    The NLA Megatron critic's pipeline guard is raised on its own, so that its first line is the fork's sentence."""
    errors = number_errors(cfg)  # first and alone: NaN passes every range, and huge numbers stall the arithmetic below
    if errors:
        raise ConfigError(_joined(errors))
    if isinstance(cfg, NLATrainConfig) and megatron_critic_pipeline_error(cfg) is not None:
        raise ConfigError(megatron_critic_pipeline_error(cfg))
    if isinstance(cfg, EmberConfig):
        errors = _rl_errors(cfg) + (nla_train_errors(cfg) if isinstance(cfg, NLATrainConfig) else [])
    elif isinstance(cfg, SFTConfig):
        errors = _sft_errors(cfg) + (nla_sft_errors(cfg) if isinstance(cfg, NLASFTConfig) else [])
    else:
        errors = nla_extract_errors(cfg) if isinstance(cfg, NLAExtractConfig) else []
    if errors:
        raise ConfigError(_joined(errors))


def _joined(errors: list[str]) -> str:
    return errors[0] if len(errors) == 1 else "invalid configuration:\n  - " + "\n  - ".join(errors)


def _bound_errors(cfg: Any, bounds: list[Bound]) -> list[str]:
    errors = []
    for bound in bounds:
        value = value_at(cfg, bound.path)
        if value is not None and bound.violated_by(value):
            errors.append(f"{bound.path}={value} is out of range: it {bound.describe()}")
    return errors


def _at_least_one(*paths: str) -> list[Bound]:
    return [Bound(path, low=1) for path in paths]


def _run_bounds() -> list[Bound]:
    return [*_at_least_one("trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs", "trainer.total_training_steps"),
            Bound("trainer.save_freq", low=-1), Bound("trainer.test_freq", low=-1),
            Bound("trainer.max_loss_or_grad_norm", low=0, low_open=True)]


def _logger_package_errors(loggers: list[str]) -> list[str]:
    """A logger whose package is missing stops the run here, before any model is loaded."""
    return [f"trainer.logger names {name}, but the {name} package is not installed: "
            f"pip install 'ember[{name}]' (or remove {name} from trainer.logger)"
            for name in LOGGERS_FROM_EXTRAS if name in loggers and importlib.util.find_spec(name) is None]


def _megatron_bounds(path: str, megatron: MegatronConfig | None) -> list[Bound]:
    return [] if megatron is None else _at_least_one(*(f"{path}.{name}" for name in _MEGATRON_SIZES))


def _rl_bounds(cfg: EmberConfig) -> list[Bound]:
    probability = dict(low=0.0, high=1.0)
    bounds = [
        *_at_least_one("data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "data.val_batch_size",
                       "data.filter_overlong_prompts_workers"),
        Bound("data.dataloader_num_workers", low=0),
        *(Bound(f"data.{name}_max_samples", low=-1) for name in ("train", "val")),
        *_at_least_one(*(f"{_ACTOR}.{name}" for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                                                         "ppo_epochs", "ulysses_sequence_parallel_size"))),
        Bound(f"{_ACTOR}.grad_clip", low=0.0, low_open=True),
        *(Bound(f"{_ACTOR}.{name}", low=0.0) for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "kl_loss_coef")),
        Bound(f"{_ACTOR}.clip_ratio_c", low=1.0, low_open=True),
        Bound(f"{_ACTOR}.loss_scale_factor", low=0.0, low_open=True),
        Bound("actor_rollout_ref.model.lora_rank", low=0),
        *_at_least_one(*(f"{_REF}.{name}" for name in ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu",
                                                       "ulysses_sequence_parallel_size"))),
        *_at_least_one(*(f"{_ROLLOUT}.{name}" for name in ("prompt_length", "response_length", "tensor_model_parallel_size",
                                                           "data_parallel_size", "max_num_batched_tokens", "max_model_len",
                                                           "max_num_seqs", "log_prob_micro_batch_size_per_gpu",
                                                           "log_prob_max_token_len_per_gpu", "n", "val_kwargs.n"))),
        Bound(f"{_ROLLOUT}.gpu_memory_utilization", low=0.0, high=1.0, low_open=True),
        *(Bound(f"{_ROLLOUT}.{prefix}top_p", **probability) for prefix in ("", "val_kwargs.")),
        *(Bound(f"{_ROLLOUT}.{prefix}top_k", low=-1) for prefix in ("", "val_kwargs.")),
        *(Bound(f"{_ROLLOUT}.{prefix}temperature", low=0.0) for prefix in ("", "val_kwargs.")),
        *_at_least_one(*(f"critic.{name}" for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                                                       "forward_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                                                       "forward_max_token_len_per_gpu", "ulysses_sequence_parallel_size",
                                                       "ppo_epochs"))),
        Bound("critic.grad_clip", low=0.0, low_open=True),
        Bound("critic.cliprange_value", low=0.0),
        *_at_least_one("reward_model.micro_batch_size_per_gpu", "reward_model.max_length"),
        Bound("reward_model.num_workers", low=0),
        Bound("reward_model.timeout_s", low=0.0, low_open=True),
        Bound("algorithm.gamma", **probability),
        Bound("algorithm.lam", **probability),
        Bound("algorithm.kl_ctrl.kl_coef", low=0.0),
        Bound("algorithm.kl_ctrl.horizon", low=1),
        Bound("algorithm.kl_ctrl.target_kl", low=0.0, low_open=True),
        *_run_bounds(),
        *_at_least_one("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.noise_injection.num_stages",
                       "ray_init.num_cpus"),
        *(Bound(f"trainer.{name}", low=0) for name in ("critic_warmup", "log_val_generations")),
        *(Bound(f"trainer.noise_injection.{name}", low=0.0) for name in ("sigma_start", "sigma_end")),
    ]
    for path in (f"{_ACTOR}.optim", "critic.optim"):
        bounds += [Bound(f"{path}.lr", low=0.0), Bound(f"{path}.weight_decay", low=0.0),
                   Bound(f"{path}.lr_warmup_steps_ratio", **probability), Bound(f"{path}.min_lr_ratio", **probability)]
    for path in (_ACTOR, _REF, "critic"):
        bounds += _megatron_bounds(f"{path}.megatron", value_at(cfg, path).megatron)
    return bounds


def _betas_errors(path: str, betas: list[float]) -> list[str]:
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        return [f"{path}={betas} is invalid: give two decay rates in [0, 1), e.g. [0.9, 0.999]"]
    return []


def _gpus_text(cfg: Any, role: str | None) -> tuple[int, str]:
    """The GPUs a role runs on (its resource pool's, or the whole run's) and how a message names them."""
    world = world_size(cfg.trainer)
    run = f"the {world} GPUs (trainer.nnodes × trainer.n_gpus_per_node = {cfg.trainer.nnodes} × {cfg.trainer.n_gpus_per_node})"
    if role is None:
        return world, run
    gpus = role_gpus(cfg, role)
    return (gpus, run) if gpus == world else (gpus, f"the {gpus} GPUs of its resource pool")


def _parallel_errors(role: str, strategy: str, megatron: MegatronConfig | None, ulysses: int, cfg: Any,
                     pool_role: str | None = None) -> list[str]:
    """Model-parallel sizes of a role that do not divide its GPUs (`pool_role`: its resource pool; None: the run's)."""
    world, gpus = _gpus_text(cfg, pool_role)
    if strategy != "megatron" or megatron is None:
        if ulysses >= 1 and world % ulysses:
            return [f"{role}.ulysses_sequence_parallel_size={ulysses} does not divide {gpus}; use one of {nearest_divisors(world, ulysses)}"]
        return []
    errors = []
    tp, pp, cp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size, megatron.context_parallel_size
    if min(tp, pp, cp) >= 1 and world % (tp * pp * cp):
        errors.append(f"{role}.megatron: tensor × pipeline × context parallel size = {tp} × {pp} × {cp} = {tp * pp * cp} "
                      f"does not divide {gpus}; choose sizes whose product divides {world}")
    ep = megatron.expert_model_parallel_size
    etp = megatron.expert_tensor_parallel_size or tp
    if min(ep, etp, pp) >= 1 and world % (etp * ep * pp):
        errors.append(f"{role}.megatron: expert tensor × expert model × pipeline parallel size = {etp} × {ep} × {pp} = "
                      f"{etp * ep * pp} does not divide {gpus}; choose sizes whose product divides {world}")
    if megatron.virtual_pipeline_model_parallel_size is not None and pp == 1:
        errors.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={megatron.virtual_pipeline_model_parallel_size} "
                      f"needs {role}.megatron.pipeline_model_parallel_size > 1; set it to null or raise the pipeline size")
    return errors


def _mini_batch_errors(role: str, mini: int, micro: int | None, dynamic: bool, data_parallel: int, cfg: EmberConfig) -> list[str]:
    """A step's batch must split into whole mini-batches, and each mini-batch evenly over ranks and micro-batches."""
    train, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    if min(train, mini, n) < 1 or data_parallel < 1:
        return []  # reported by the range and parallel-size checks
    if train % mini:
        return [f"data.train_batch_size={train} is not divisible by {role}.ppo_mini_batch_size={mini}: every step must split into "
                f"whole mini-batches; use a mini-batch size such as {nearest_divisors(train, mini)}"]
    responses = mini * n
    if responses % data_parallel:
        return [f"{role}.ppo_mini_batch_size × {_ROLLOUT}.n = {mini} × {n} = {responses} responses per mini-batch cannot be split "
                f"evenly over {data_parallel} data-parallel ranks; make the product divisible by {data_parallel}"]
    per_gpu = responses // data_parallel
    if micro is not None and micro >= 1 and not dynamic and per_gpu % micro:
        return [f"{role}.ppo_micro_batch_size_per_gpu={micro} does not divide the per-GPU mini-batch of {per_gpu} responses "
                f"(ppo_mini_batch_size × rollout.n / data-parallel size = {mini} × {n} / {data_parallel}); "
                f"use one of {nearest_divisors(per_gpu, micro)}"]
    return []


def _layout(section: Any) -> tuple:
    """What decides a role's model-parallel group: backend, Ulysses size and Megatron sizes."""
    sizes = tuple(getattr(section.megatron, name) for name in _MEGATRON_SIZES)
    return section.strategy, section.ulysses_sequence_parallel_size, sizes


def _dapo_errors(cfg: EmberConfig) -> list[str]:
    """DAPO's dynamic sampling and overlong shaping: what they need to mean anything."""
    errors = []
    groups, overlong = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    if groups.enable and groups.metric is None:
        errors.append("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (acc, score, "
                      "seq_reward or seq_final_reward): the number whose spread within a group keeps it")
    if groups.max_num_gen_batches < 0:
        errors.append(f"algorithm.filter_groups.max_num_gen_batches={groups.max_num_gen_batches}: use 0 (no limit) "
                      "or a positive number of generation rounds")
    if cfg.data.gen_batch_size is not None and cfg.data.gen_batch_size < 1:
        errors.append(f"data.gen_batch_size={cfg.data.gen_batch_size}: give at least 1 prompt per round, or null")
    if overlong.enable:
        if cfg.reward_model.reward_manager != "dapo":
            errors.append(f"reward_model.overlong_buffer.enable=true shapes rewards in the dapo reward manager, but "
                          f"reward_model.reward_manager={cfg.reward_model.reward_manager}: set it to dapo")
        if not 0 < overlong.len <= cfg.data.max_response_length:
            errors.append(f"reward_model.overlong_buffer.len={overlong.len}: give a length in 1.."
                          f"{cfg.data.max_response_length} (data.max_response_length)")
    return errors


def _rollout_correction_errors(cfg: EmberConfig) -> list[str]:
    """verl's rollout correction keys: a positive truncation and a rejection rule that parses."""
    correction, path = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    errors = []
    if correction.rollout_is is not None and not correction.rollout_is_threshold > 0:
        errors.append(f"{path}.rollout_is_threshold={correction.rollout_is_threshold}: give a positive upper bound of "
                      "the importance weights (typical 2.0-5.0)")
    if correction.rollout_rs is not None:
        try:
            parse_rejection(correction.rollout_rs, correction.rollout_rs_threshold)
        except ValueError as error:
            errors.append(f"{path}: {error}")
    return errors


def _async_errors(cfg: EmberConfig) -> list[str]:
    """A rollout pool apart from the trainer's (hybrid_engine=false) and the loop that overlaps generation."""
    errors = []
    mode, hybrid = cfg.async_training.mode, cfg.actor_rollout_ref.hybrid_engine
    if mode not in ASYNC_MODES:
        errors.append(f"async_training.mode={mode} is not a mode; choose one of {', '.join(ASYNC_MODES)}")
    if mode in ("one_step_off", "fully_async") and hybrid:
        errors.append(f"async_training.mode={mode} generates on GPUs of its own while the actor trains: set "
                      "actor_rollout_ref.hybrid_engine=false and give the rollout pool's size (rollout.nnodes, "
                      "rollout.n_gpus_per_node), or use async_training.mode=sync")
    errors += _fully_async_errors(cfg.async_training)
    if not hybrid:
        for key in ("nnodes", "n_gpus_per_node"):
            if getattr(cfg.rollout, key) < 1:
                errors.append(f"rollout.{key}={getattr(cfg.rollout, key)}: actor_rollout_ref.hybrid_engine=false puts "
                              "the rollout on GPUs of its own; give it at least 1")
    return errors


def _fully_async_errors(section) -> list[str]:
    """verl's fully-async keys: sane values, and only with async_training.mode=fully_async."""
    errors = []
    defaults = AsyncTrainingConfig()
    for key in ("staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout"):
        value = getattr(section, key)
        if section.mode != "fully_async" and value != getattr(defaults, key):
            errors.append(f"async_training.{key}={value} applies to async_training.mode=fully_async only (the mode "
                          f"is {section.mode}): set the mode, or remove the key")
    if not section.staleness_threshold >= 0:
        errors.append(f"async_training.staleness_threshold={section.staleness_threshold}: give 0 or more (updates a "
                      "sample's weights may be behind)")
    if section.trigger_parameter_sync_step < 1:
        errors.append(f"async_training.trigger_parameter_sync_step={section.trigger_parameter_sync_step}: give 1 or "
                      "more (updates between weight syncs)")
    if section.require_batches != 1:
        errors.append(f"async_training.require_batches={section.require_batches}: ember's step trains "
                      "data.train_batch_size prompts; set require_batches=1 and data.train_batch_size to "
                      "require_batches × ppo_mini_batch_size instead")
    return errors


def _quantization_errors(cfg: EmberConfig) -> list[str]:
    """`rollout.quantization`: FP8 generation is a feature of ember's own engine."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.quantization is None or rollout.engine == "ember":
        return []
    return [f"{_ROLLOUT}.quantization={rollout.quantization} quantises ember's own engine's weights; set "
            f"{_ROLLOUT}.name=ember instead of {rollout.name}, or {_ROLLOUT}.quantization=null"]


def _multi_turn_errors(cfg: EmberConfig) -> list[str]:
    """`rollout.multi_turn`: its sizes, and what the agent loop needs (tools, ember's engine, one rank per replica)."""
    rollout = cfg.actor_rollout_ref.rollout
    multi_turn, path = rollout.multi_turn, f"{_ROLLOUT}.multi_turn"
    if not multi_turn.enable:
        return []
    errors = []
    for name, low in (("max_assistant_turns", 1), ("max_user_turns", 0)):
        value = getattr(multi_turn, name)
        if value is not None and value < low:
            errors.append(f"{path}.{name}={value}: set at least {low}, or null for no limit")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        if getattr(multi_turn, name) < 1:
            errors.append(f"{path}.{name}={getattr(multi_turn, name)}: set at least 1")
    if not multi_turn.tool_timeout > 0:
        errors.append(f"{path}.tool_timeout={multi_turn.tool_timeout}: give a positive number of seconds")
    if not multi_turn.tool_config_path:
        errors.append(f"{path}.enable=true needs {path}.tool_config_path (a YAML of tools, verl's format); ember's "
                      "multi-turn rollouts are tool turns")
    if rollout.engine != "ember":
        errors.append(f"{path}.enable=true runs on ember's own engine (its agent loop adds requests between engine "
                      f"steps); set {_ROLLOUT}.name=ember instead of {rollout.name}")
    if rollout.tensor_model_parallel_size > 1:
        errors.append(f"{path}.enable=true with {_ROLLOUT}.tensor_model_parallel_size="
                      f"{rollout.tensor_model_parallel_size}: the ranks of a split engine would need their tool results "
                      "at the same engine step; use tensor_model_parallel_size=1")
    if not cfg.actor_rollout_ref.hybrid_engine:
        errors.append(f"{path}.enable=true with actor_rollout_ref.hybrid_engine=false is not built yet (the agent loop "
                      "runs beside the actor); use hybrid_engine=true")
    return errors


def _rl_errors(cfg: EmberConfig) -> list[str]:
    errors = _bound_errors(cfg, _rl_bounds(cfg)) + _logger_package_errors(cfg.trainer.logger)
    world = world_size(cfg.trainer)
    actor, ref, critic = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic
    rollout = cfg.actor_rollout_ref.rollout
    roles = [(_ACTOR, actor)]
    ref_used = actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    if ref_used and _layout(ref) != _layout(actor):
        roles.append((_REF, ref))
    if critic.enable:
        roles.append(("critic", critic))
    errors += lora_errors(_MODEL, cfg.actor_rollout_ref.model, actor.strategy, f"{_ACTOR}.strategy")
    if ref_used and ref.strategy != actor.strategy:  # a LoRA reference is the actor's module without its adapter
        errors += lora_errors(_MODEL, cfg.actor_rollout_ref.model, ref.strategy, f"{_REF}.strategy")
    for role, section in roles:
        errors += _parallel_errors(role, section.strategy, section.megatron, section.ulysses_sequence_parallel_size, cfg,
                                   pool_role=_POOL_ROLE[role])
    for role, section in ((_ACTOR, actor), ("critic", critic)):
        if role == "critic" and not critic.enable:
            continue
        data_parallel = data_parallel_size(role_gpus(cfg, _POOL_ROLE[role]), section.strategy, section.megatron,
                                           section.ulysses_sequence_parallel_size)
        errors += _mini_batch_errors(role, section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu,
                                     section.use_dynamic_bsz, data_parallel, cfg)
    rollout_gpus, rollout_gpus_text = (_gpus_text(cfg, "actor_rollout") if cfg.actor_rollout_ref.hybrid_engine else
                                       (cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node,
                                        "the rollout pool's GPUs (rollout.nnodes × rollout.n_gpus_per_node)"))
    if rollout.tensor_model_parallel_size >= 1 and rollout_gpus >= 1 and rollout_gpus % rollout.tensor_model_parallel_size:
        errors.append(f"{_ROLLOUT}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} does not divide "
                      f"{rollout_gpus_text}; use one of "
                      f"{nearest_divisors(rollout_gpus, rollout.tensor_model_parallel_size)}")
    for path in (f"{_ACTOR}.fsdp_config", f"{_REF}.fsdp_config", "critic.model.fsdp_config"):
        fsdp_size = value_at(cfg, path).fsdp_size
        if fsdp_size == 0 or fsdp_size < -1 or (fsdp_size > 0 and world % fsdp_size):
            errors.append(f"{path}.fsdp_size={fsdp_size} is invalid: use -1 (all GPUs of the role) or a divisor of the {world} GPUs")
    if rollout.max_model_len is not None and rollout.max_model_len < rollout.prompt_length + rollout.response_length:
        errors.append(f"{_ROLLOUT}.max_model_len={rollout.max_model_len} is shorter than prompt_length + response_length = "
                      f"{rollout.prompt_length} + {rollout.response_length}; raise it or set it to null")
    if rollout.engine == "hf" and actor.fsdp_config.offload_policy:
        errors.append(f"{_ROLLOUT}.name=hf generates with the actor's own module, whose weights "
                      f"{_ACTOR}.fsdp_config.offload_policy=true keeps in CPU memory: use {_ROLLOUT}.name=ember "
                      "(its own copy on the GPU) or param_offload/optimizer_offload instead of the policy")
    if cfg.algorithm.adv_estimator == "gae" and not critic.enable:
        errors.append("algorithm.adv_estimator=gae needs a critic but critic.enable=false; "
                      "remove critic.enable=false or choose a critic-free estimator such as grpo")
    errors += (_dapo_errors(cfg) + _profiler_errors(cfg) + _rollout_correction_errors(cfg) + _async_errors(cfg)
               + _multi_turn_errors(cfg) + _quantization_errors(cfg))
    if cfg.trainer.resume_mode == "resume_path" and cfg.trainer.resume_from_path is None:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (the checkpoint folder to resume from)")
    if cfg.reward_model.enable and cfg.reward_model.model.path is None:
        errors.append("reward_model.enable=true needs reward_model.model.path (the reward model to load)")
    for path in (f"{_ACTOR}.optim", "critic.optim"):
        errors += _betas_errors(f"{path}.betas", value_at(cfg, path).betas)
    return errors + placement_errors(cfg)


def _profiler_errors(cfg: EmberConfig) -> list[str]:
    profiler = cfg.global_profiler
    if profiler.tool is None:
        return ([f"global_profiler.steps={profiler.steps} profiles nothing without a tool: add global_profiler.tool=torch"]
                if profiler.steps else [])
    if profiler.tool not in ("torch", "torch_memory"):
        return [f"global_profiler.tool={profiler.tool} is not implemented yet; use torch (torch.profiler traces with "
                "a phase table per process) or torch_memory (CUDA memory snapshots)"]
    if profiler.tool == "torch_memory" and profiler.steps is None:
        return []  # a snapshot after every step, as verl takes it
    if not profiler.steps:
        return [f"global_profiler.tool={profiler.tool} needs global_profiler.steps, the training steps to profile, "
                "e.g. [2]"]
    if min(profiler.steps) < 1:
        return [f"global_profiler.steps={profiler.steps}: steps count from 1"]
    return []


def sft_accumulation_note(cfg: SFTConfig) -> str | None:
    """A warning when `training.gradient_accumulation_steps` disagrees with the batch sizes.

    ember follows verl's SFT meaning: `data.train_batch_size` is the global batch of one
    optimizer step and the accumulation follows from it (train_batch_size / (micro-batch ×
    data-parallel size)); the Megatron-style dialect's own number is only checked against it.
    """
    accumulation = cfg.training.gradient_accumulation_steps
    if accumulation is None or cfg.data.use_dynamic_bsz:
        return None
    data_parallel = data_parallel_size(world_size(cfg.trainer), cfg.model.strategy, cfg.model.megatron,
                                       cfg.ulysses_sequence_parallel_size)
    micro, batch = cfg.data.micro_batch_size_per_gpu, cfg.data.train_batch_size
    derived = batch // (micro * data_parallel)
    if derived == accumulation:
        return None
    return (f"training.gradient_accumulation_steps={accumulation} disagrees with data.train_batch_size={batch} = "
            f"micro-batch {micro} × data-parallel size {data_parallel} × accumulation {derived}; using "
            f"{derived} (verl's meaning: train_batch_size is the global batch of one optimizer step)")


def _sft_errors(cfg: SFTConfig) -> list[str]:
    model = cfg.model
    bounds = [*_at_least_one("data.max_length", "data.train_batch_size", "data.micro_batch_size_per_gpu",
                             "training.gradient_accumulation_steps", "ulysses_sequence_parallel_size", "trainer.max_ckpt_to_keep"),
              Bound("optim.lr", low=0.0), Bound("optim.weight_decay", low=0.0), Bound("optim.warmup_steps_ratio", low=0.0, high=1.0),
              Bound("optim.clip_grad", low=0.0, low_open=True), Bound("model.lora_rank", low=0),
              *_run_bounds(), *_megatron_bounds("model.megatron", model.megatron)]
    errors = _bound_errors(cfg, bounds) + _betas_errors("optim.betas", cfg.optim.betas)
    errors += _logger_package_errors(cfg.trainer.logger)
    errors += _parallel_errors("model", model.strategy, model.megatron, cfg.ulysses_sequence_parallel_size, cfg)
    strategy = model.strategy or ("megatron" if model.megatron is not None else "fsdp2")
    errors += lora_errors("model", model, strategy, "model.strategy")
    if errors:
        return errors
    data_parallel = data_parallel_size(world_size(cfg.trainer), model.strategy, model.megatron, cfg.ulysses_sequence_parallel_size)
    batch, micro = cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu
    accumulation = cfg.training.gradient_accumulation_steps
    if cfg.data.use_dynamic_bsz:
        if cfg.data.max_token_len_per_gpu < 1:
            return [f"data.max_token_len_per_gpu={cfg.data.max_token_len_per_gpu}: give at least 1 token per micro-batch"]
        if accumulation is not None:
            return ["training.gradient_accumulation_steps is set, but data.use_dynamic_bsz=true forms micro-batches "
                    "by data.max_token_len_per_gpu: remove one of the two"]
        if batch % data_parallel:
            return [f"data.train_batch_size={batch} is not divisible by the data-parallel size {data_parallel}"]
        return []
    if batch % (micro * data_parallel):
        return [f"data.train_batch_size={batch} is not divisible by data.micro_batch_size_per_gpu × data-parallel size = "
                f"{micro} × {data_parallel}; use a batch size that is a multiple of {micro * data_parallel}"]
    return []
