"""Builds the parts of an RL run from its configuration: on the driver the tokenizer, datasets,
reward manager and a worker group per resource pool (`build_components`); in each worker
process the roles placed there (`build_rank_roles`: actor and rollout, reference, critic).

Each builder reads only its own config slice and hands plain options to the component, so
the components never see the whole configuration.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from ember.algorithms import ClipConfig
from ember.config import ConfigError
from ember.config.schema import EmberConfig
from ember.config.schema.rollout import STAND_IN_NAMES
from ember.data.prompt_loader import PromptLoader
from ember.data.rl_dataset import RLDataset
from ember.config.parallel import world_size as world_size_of
from ember.config.placement import Placement, Pool, plan_placement
from ember.distributed.device import current_device, device_type, request_device, world_size
from ember.distributed.ray_cluster import start_ray, write_timeline
from ember.distributed.worker_group import LocalWorkerGroup, RayWorkerGroup
from ember.engines.base import MicroBatchSpec, TrainEngine
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.inference.config import EngineConfig
from ember.models.loading import build_model_on_meta, load_model_config, resolve_dtype
from ember.rewards import RewardManager, resolve_reward_fn
from ember.rollout import build_rollout
from ember.trainer.checkpoint import check_resume_path
from ember.trainer.rank_worker import RankWorker
from ember.trainer.role_groups import ActorGroup, CriticGroup, ReferenceGroup, RolloutGroup
from ember.workers.actor import Actor, ActorOptions
from ember.workers.critic import Critic, CriticOptions
from ember.workers.reconstructor import Reconstructor, ReconstructorOptions
from ember.workers.reference import Reference
from ember.workers.noise_injection import NoiseInjection, build_noise_injection
from ember.workers.rollout import PolicyRollout

logger = logging.getLogger(__name__)


@dataclass
class RLComponents:
    """Everything the RL loop drives: the data, the roles (wherever their processes run) and the rewards."""

    tokenizer: PreTrainedTokenizerBase
    train_loader: PromptLoader
    val_dataset: RLDataset | None
    actor: ActorGroup
    reference: ReferenceGroup | None
    critic: CriticGroup | None
    rollout: RolloutGroup
    reward_manager: RewardManager | None  # None: the run scores otherwise (NLA's reconstructor)
    eos_token_ids: list[int]
    total_steps: int
    timeline_file: str | None = None  # `ray_init.timeline_json_file` of a run on Ray workers
    noise: NoiseInjection | None = None  # trainer.noise_injection (its metrics; the rollout ranks apply it)

    def shutdown(self) -> None:
        """Write the Ray timeline when asked for one, then stop the worker processes of every pool (a
        no-op for roles in this process)."""
        groups = {id(role.group): role.group for role in (self.actor, self.reference, self.critic) if role is not None}
        if self.timeline_file and any(isinstance(group, RayWorkerGroup) for group in groups.values()):
            write_timeline(self.timeline_file)
        for group in groups.values():
            group.shutdown()


def use_configured_device(name: str) -> None:
    """Compute on `trainer.device` (auto, cpu, or this machine's accelerator type); any other is a config error."""
    try:
        request_device(name)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def compute_dtype(configured: str) -> str:
    """`auto` means bfloat16 on an accelerator and float32 on the CPU."""
    if configured != "auto":
        return configured
    return "float32" if device_type() == "cpu" else "bfloat16"


def uses_critic(cfg: EmberConfig) -> bool:
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: EmberConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "Qwen/Qwen2.5-0.5B": fetched by transformers, not a local path
MODEL_CONFIG_FILE = "config.json"  # what transformers reads first from a model folder (architecture, sizes)


def check_model_path(key: str, path: str, *, tokenizer_only: bool = False) -> None:
    """A model path must be a Hugging Face model folder (holding config.json), or read as a hub id
    when nothing is at that path; a tokenizer path (`tokenizer_only`) any existing folder or hub id."""
    if os.path.isdir(path):
        if tokenizer_only or os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE)):
            return
        raise ConfigError(f"{key}={path} holds no {MODEL_CONFIG_FILE}, so it is not a Hugging Face model folder; "
                          f"point it at the folder with the model's {MODEL_CONFIG_FILE} and weights")
    if os.path.exists(path):
        raise ConfigError(f"{key}={path} is a file, not a folder; point it at a Hugging Face model folder "
                          f"(the one holding {MODEL_CONFIG_FILE}, the weights and the tokenizer)")
    if HUB_ID.fullmatch(path) and not path.startswith("."):
        return
    raise ConfigError(f"{key}={path} does not exist; point it at a Hugging Face model folder (or a hub id)")


def check_override_config(key: str, model_path: str, overrides: dict) -> None:
    """Each field `<key>.override_config` replaces must be one the model's config has (a typo would
    otherwise change nothing)."""
    if not overrides or not os.path.isdir(model_path):
        return
    config = AutoConfig.from_pretrained(model_path)
    unknown = sorted(name for name in overrides if not hasattr(config, name))
    if unknown:
        raise ConfigError(f"{key}.override_config sets {', '.join(unknown)}, which the model's config "
                          f"({type(config).__name__}, {model_path}) does not have; override fields it has "
                          "(e.g. attention_dropout, or output_router_logits for a MoE model)")


def check_data_files(key: str, files: str | list[str] | None) -> None:
    """Each file a data key names (one path or a list; None names none) must exist."""
    for path in [files] if isinstance(files, str) else files or []:
        if not os.path.isfile(path):
            raise ConfigError(f"{key}: file not found: {path}")


def check_output_dir(key: str, path: str) -> None:
    """The folder a run writes to (checkpoints, config.yaml, metrics, TensorBoard) is created now,
    so that a path that cannot be written stops the run before any work, naming `key`."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path} is a file, not a folder; point it at a folder for the run's outputs")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{key}={path} cannot be created ({error.strerror}: {error.filename}); "
                          "point it at a folder you can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path} is not writable; point it at a folder you can write")


def check_input_paths(cfg: EmberConfig) -> None:
    """Stops a run before any work when a model, tokenizer, data file, reward file or
    checkpoint it names does not exist, or its output folder cannot be written, naming the key to change."""
    arr = cfg.actor_rollout_ref
    if arr.model.path is None:
        raise ConfigError("actor_rollout_ref.model.path is not set; point it at a Hugging Face model folder or hub id "
                          "(or leave out data.train_files too for the built-in demo)")
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is not set; give the parquet file(s) of training prompts (`ember "
                          "preprocess` writes them; leave out actor_rollout_ref.model.path too for the built-in demo)")
    models = {"actor_rollout_ref.model.path": arr.model.path}
    if uses_critic(cfg):
        models["critic.model.path"] = cfg.critic.model.path
    for key, path in models.items():
        if path is not None:
            check_model_path(key, path)
    check_override_config("actor_rollout_ref.model", arr.model.path, arr.model.override_config)
    if uses_critic(cfg) and cfg.critic.model.path is not None:
        check_override_config("critic.model", cfg.critic.model.path, cfg.critic.model.override_config)
    for key, path in {"actor_rollout_ref.model.tokenizer_path": arr.model.tokenizer_path,
                      "data.tokenizer": cfg.data.tokenizer}.items():
        if path is not None:
            check_model_path(key, path, tokenizer_only=True)
    check_data_files("custom_reward_function.path", cfg.custom_reward_function.path)
    check_data_files("data.train_files", cfg.data.train_files)
    check_data_files("data.val_files", cfg.data.val_files)
    if cfg.trainer.resume_mode == "resume_path":
        check_resume_path(cfg.trainer.resume_from_path)
    check_output_dir("trainer.default_local_dir", cfg.trainer.default_local_dir)


def load_tokenizer(cfg: EmberConfig) -> PreTrainedTokenizerBase:
    model = cfg.actor_rollout_ref.model
    path = cfg.data.tokenizer or model.tokenizer_path or model.path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token_id is None:  # e.g. Llama/SmolLM2 tokenizers: pad with EOS
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer and the checkpoint's generation config (chat models end
    turns with their own token, e.g. <|im_end|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if os.path.exists(os.path.join(model_path, "generation_config.json")):
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if not ids:
        raise ValueError(f"neither the tokenizer nor {model_path}/generation_config.json names an EOS token; "
                         "set eos_token in the tokenizer config")
    return sorted(ids)


def build_dataset(files, tokenizer, cfg: EmberConfig) -> RLDataset:
    data = cfg.data
    return RLDataset(files, tokenizer, prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                     filter_overlong_prompts=data.filter_overlong_prompts, truncation=data.truncation,
                     return_raw_chat=data.return_raw_chat, reward_fn_key=data.reward_fn_key)


def optimizer_steps_per_rl_step(cfg: EmberConfig, ppo_epochs: int, mini_batch_size: int) -> int:
    """Optimizer steps one RL step makes: verl counts schedules in RL steps, the engine in updates."""
    return ppo_epochs * max(cfg.data.train_batch_size // mini_batch_size, 1)


def optim_options(optim, grad_clip: float, total_rl_steps: int, updates_per_step: int) -> OptimOptions:
    scheduler = optim.warmup_style or optim.lr_scheduler_type
    warmup = optim.lr_warmup_steps * updates_per_step if optim.lr_warmup_steps >= 0 else -1
    return OptimOptions(lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas), clip_grad=grad_clip,
                        lr_warmup_steps=warmup, lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
                        lr_scheduler_type=scheduler, min_lr_ratio=optim.min_lr_ratio, num_cycles=optim.num_cycles,
                        total_training_steps=total_rl_steps * updates_per_step)


def build_engine(model_path: str, role: str, model_cfg, fsdp_config, optim: OptimOptions | None, seed: int, *,
                 use_remove_padding: bool = False, use_fused_kernels: bool = False,
                 compile_layers: bool = False, megatron=None, **nla) -> TrainEngine:
    """The engine for `role`: Megatron when the role's `megatron` section is given (its strategy
    is megatron), else FSDP2. The speed switches come from wherever the caller's config keeps
    them (`*.model.use_remove_padding` in RL, top-level `use_remove_padding` in SFT; compiling
    from `actor.use_torch_compile`); the Megatron engine computes on padded batches and takes
    none of them. `nla`: the FSDP engine's NLA options (injection_mode; output_layer_index and
    truncate_at_layer of a reconstructor)."""
    if megatron is not None:
        if nla or role == "reconstructor":
            raise ValueError("NLA on strategy megatron is not implemented yet; use strategy fsdp2")
        from ember.engines.megatron.engine import MegatronEngine
        from ember.engines.megatron.options import megatron_options

        ignored = [name for name, on in (("use_remove_padding", use_remove_padding), ("use_fused_kernels", use_fused_kernels),
                                         ("use_torch_compile", compile_layers)) if on]
        if ignored:
            logger.info("%s on strategy megatron: %s do not apply (it runs padded micro-batches or token budgets)",
                        role, ", ".join(ignored))
        return MegatronEngine(megatron_options(model_path, role, megatron, optim))
    return FSDPEngine(EngineOptions(
        model_path=model_path, role=role, model_dtype=fsdp_config.model_dtype,
        param_dtype=compute_dtype(model_cfg.dtype), attn_implementation=model_cfg.attn_implementation,
        enable_gradient_checkpointing=model_cfg.enable_gradient_checkpointing and role != "ref",
        use_remove_padding=use_remove_padding, use_fused_kernels=use_fused_kernels,
        reshard_after_forward=fsdp_config.reshard_after_forward, param_offload=fsdp_config.param_offload,
        optimizer_offload=fsdp_config.optimizer_offload, offload_policy=fsdp_config.offload_policy,
        compile_layers=compile_layers, seed=seed, optim=optim or OptimOptions(),
        override_config=dict(getattr(model_cfg, "override_config", None) or {}), **nla))


def run_noise_injection(cfg: EmberConfig, total_steps: int) -> NoiseInjection | None:
    """`trainer.noise_injection` resolved against the actor's architecture (an empty HF model of its
    config, so the weights' names and module types are the ones the weight stream carries)."""
    if not cfg.trainer.noise_injection.enabled:
        return None
    model = build_model_on_meta(load_model_config(cfg.actor_rollout_ref.model.path))
    return build_noise_injection(cfg.trainer.noise_injection, model, total_steps, cfg.trainer.seed)


def prompts_per_round(cfg: EmberConfig) -> int:
    """Prompts the loader hands out per generation round: `data.gen_batch_size` with DAPO's dynamic
    sampling (several rounds may make one step), else `data.train_batch_size`."""
    if cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size:
        return cfg.data.gen_batch_size
    if cfg.data.gen_batch_size and cfg.data.gen_batch_size != cfg.data.train_batch_size:
        logger.warning("data.gen_batch_size=%d applies to DAPO's dynamic sampling only (algorithm.filter_groups."
                       "enable=true); each step generates data.train_batch_size=%d prompts", cfg.data.gen_batch_size,
                       cfg.data.train_batch_size)
    return cfg.data.train_batch_size


def stand_in_note(rollout_cfg) -> str:
    """What a run with `rollout.name` vllm or sglang is told: ember's engine runs in its place, with
    the keys it honours, and the set keys it does not."""
    name = rollout_cfg.name
    ignored = [f"load_format={rollout_cfg.load_format}"] if rollout_cfg.load_format != "dummy_dtensor" else []
    ignored += [f"engine_kwargs.{name}.{key}" for key in sorted(rollout_cfg.engine_kwargs.get(name) or {})]
    ignored += ["layered_summon=true"] if rollout_cfg.layered_summon else []
    note = (f"actor_rollout_ref.rollout.name={name}: ember's own engine generates in its place, honouring "
            "gpu_memory_utilization, enforce_eager, free_cache_engine, max_num_batched_tokens, max_num_seqs, "
            "enable_chunked_prefill and the sampling keys (set rollout.require_named_engine=true to stop instead)")
    return note + (f"; not applied: {', '.join(ignored)}" if ignored else "")


def megatron_section(role_cfg):
    """The role's `megatron` section when its strategy is megatron (its defaults when the section
    is absent), else None (FSDP2)."""
    if role_cfg.strategy != "megatron":
        return None
    from ember.config.schema.megatron import MegatronConfig

    return role_cfg.megatron or MegatronConfig()


def micro_batch_spec(use_dynamic_bsz: bool, max_token_len: int, micro_batch_size: int | None,
                     default_size: int) -> MicroBatchSpec:
    """A token budget with dynamic batch size, else the configured sample count (null: `default_size`)."""
    if use_dynamic_bsz:
        return MicroBatchSpec(max_token_len=max_token_len)
    return MicroBatchSpec(size=micro_batch_size or default_size)


def engine_config(rollout) -> EngineConfig:
    """ember's generation engine sized from `actor_rollout_ref.rollout`."""
    max_model_len = rollout.max_model_len or rollout.prompt_length + rollout.response_length
    budget = rollout.max_num_batched_tokens
    if not rollout.enable_chunked_prefill:  # then one step must hold a whole sequence
        budget = max(budget, max_model_len)
    return EngineConfig(max_model_len=max_model_len, max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=budget,
                        enable_chunked_prefill=rollout.enable_chunked_prefill,
                        gpu_memory_utilization=rollout.gpu_memory_utilization,
                        dtype=resolve_dtype(compute_dtype(rollout.dtype)), device=str(current_device()),
                        use_cuda_graphs=not rollout.enforce_eager)


def total_training_steps(cfg: EmberConfig, steps_per_epoch: int) -> int:
    return cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs


def build_rank_roles(cfg: EmberConfig, roles: tuple[str, ...], total_steps: int) -> dict[str, object]:
    """The roles one process holds (see `rank_worker.py`), each sized for its data-parallel share:
    "actor" (with "rollout" beside it), "reference", "critic"."""
    arr = cfg.actor_rollout_ref
    model_path = arr.model.path
    n = arr.rollout.n
    dp_size = world_size()
    batch_samples = cfg.data.train_batch_size * n
    speed_switches = dict(use_remove_padding=arr.model.use_remove_padding,
                          use_fused_kernels=arr.model.use_fused_kernels, compile_layers=arr.actor.use_torch_compile)
    nla = getattr(cfg, "nla", None)  # an NLA run (`ember nla train`): vectors injected in the actor's forwards
    if nla is not None:
        speed_switches["injection_mode"] = nla.injection.mode
    built: dict[str, object] = {}
    if "actor" in roles:
        actor_cfg, rollout_cfg = arr.actor, arr.rollout
        actor_updates = optimizer_steps_per_rl_step(cfg, actor_cfg.ppo_epochs, actor_cfg.ppo_mini_batch_size)
        actor_engine = build_engine(model_path, "actor", arr.model, actor_cfg.fsdp_config,
                                    optim_options(actor_cfg.optim, actor_cfg.grad_clip, total_steps, actor_updates),
                                    seed=cfg.trainer.seed, megatron=megatron_section(actor_cfg), **speed_switches)
        mini_batch_samples = actor_cfg.ppo_mini_batch_size * n // dp_size
        actor = Actor(actor_engine, ActorOptions(
            mini_batch_samples=mini_batch_samples,
            micro_batch=micro_batch_spec(actor_cfg.use_dynamic_bsz, actor_cfg.ppo_max_token_len_per_gpu,
                                         actor_cfg.ppo_micro_batch_size_per_gpu, mini_batch_samples),
            log_prob_micro_batch=micro_batch_spec(rollout_cfg.log_prob_use_dynamic_bsz,
                                                  rollout_cfg.log_prob_max_token_len_per_gpu,
                                                  rollout_cfg.log_prob_micro_batch_size_per_gpu, batch_samples),
            ppo_epochs=actor_cfg.ppo_epochs, shuffle=actor_cfg.shuffle, policy_loss=actor_cfg.policy_loss.loss_mode,
            clip=ClipConfig(clip_ratio=actor_cfg.clip_ratio, clip_ratio_low=actor_cfg.clip_ratio_low,
                            clip_ratio_high=actor_cfg.clip_ratio_high, clip_ratio_c=actor_cfg.clip_ratio_c),
            loss_agg_mode=actor_cfg.loss_agg_mode, entropy_coeff=actor_cfg.entropy_coeff,
            use_kl_loss=actor_cfg.use_kl_loss, kl_loss_coef=actor_cfg.kl_loss_coef, kl_loss_type=actor_cfg.kl_loss_type,
            temperature=rollout_cfg.temperature, norm_length=cfg.data.max_response_length, seed=cfg.trainer.seed))
        tokenizer = load_tokenizer(cfg)
        name = rollout_cfg.engine
        if rollout_cfg.name in STAND_IN_NAMES:  # (NLA's nla_sglang says so in its own note)
            logger.warning(stand_in_note(rollout_cfg))
        engine = build_rollout(name, actor_engine.module() if name == "hf" else None, tokenizer.pad_token_id,
                               max_batch_size=rollout_cfg.max_num_seqs, model_path=model_path,
                               engine_config=engine_config(rollout_cfg) if name == "ember" else None)
        noise = run_noise_injection(cfg, total_steps)
        if name == "ember" and actor_engine.syncs_live_parameters and noise is None:
            engine.share_training_weights()  # the actor's tensors themselves become the engine's weights
        built["actor"] = actor
        built["rollout"] = PolicyRollout(engine, actor, free_cache_engine=rollout_cfg.free_cache_engine, noise=noise)
    if "reference" in roles:
        ref_cfg = arr.ref
        engine = build_engine(model_path, "ref", arr.model, ref_cfg.fsdp_config, None, seed=cfg.trainer.seed,
                              megatron=megatron_section(ref_cfg), **speed_switches)
        built["reference"] = Reference(engine, micro_batch_spec(
            ref_cfg.log_prob_use_dynamic_bsz, ref_cfg.log_prob_max_token_len_per_gpu,
            ref_cfg.log_prob_micro_batch_size_per_gpu, batch_samples), temperature=arr.rollout.temperature)
    if "critic" in roles and nla is not None:
        built["critic"] = build_reconstructor(cfg, total_steps)
    elif "critic" in roles:
        critic_cfg = cfg.critic
        critic_updates = optimizer_steps_per_rl_step(cfg, critic_cfg.ppo_epochs, critic_cfg.ppo_mini_batch_size)
        critic_engine = build_engine(critic_cfg.model.path, "critic", critic_cfg.model, critic_cfg.model.fsdp_config,
                                     optim_options(critic_cfg.optim, critic_cfg.grad_clip, total_steps, critic_updates),
                                     seed=cfg.trainer.seed, use_remove_padding=critic_cfg.model.use_remove_padding)
        mini_batch_samples = critic_cfg.ppo_mini_batch_size * n // dp_size
        critic_micro = critic_cfg.ppo_micro_batch_size_per_gpu or mini_batch_samples
        built["critic"] = Critic(critic_engine, CriticOptions(
            mini_batch_samples=mini_batch_samples,
            micro_batch=micro_batch_spec(critic_cfg.use_dynamic_bsz, critic_cfg.ppo_max_token_len_per_gpu,
                                         critic_micro, critic_micro),
            forward_micro_batch=micro_batch_spec(critic_cfg.use_dynamic_bsz, critic_cfg.forward_max_token_len_per_gpu,
                                                 critic_cfg.forward_micro_batch_size_per_gpu, critic_micro),
            ppo_epochs=critic_cfg.ppo_epochs, shuffle=critic_cfg.shuffle, cliprange_value=critic_cfg.cliprange_value,
            loss_agg_mode=critic_cfg.loss_agg_mode, norm_length=cfg.data.max_response_length, seed=cfg.trainer.seed))
    for role in ("actor", "reference", "critic"):  # param/optimizer_offload: on the device only in its phases
        if role in built:
            built[role].engine.offload()
    return built


def build_reconstructor(cfg: EmberConfig, total_steps: int) -> Reconstructor:
    """This rank's reconstructor, sized for its data-parallel share of the critic's batches."""
    critic = cfg.critic
    n = cfg.actor_rollout_ref.rollout.n
    updates = optimizer_steps_per_rl_step(cfg, critic.ppo_epochs, critic.ppo_mini_batch_size)
    engine = build_engine(critic.model.path, "reconstructor", critic.model, critic.model.fsdp_config,
                          optim_options(critic.optim, critic.grad_clip, total_steps, updates), seed=cfg.trainer.seed,
                          use_remove_padding=critic.model.use_remove_padding,
                          output_layer_index=critic.output_layer_index,
                          truncate_at_layer=critic.model.truncate_at_layer)
    mini_batch_samples = critic.ppo_mini_batch_size * n // world_size()
    micro = critic.ppo_micro_batch_size_per_gpu or mini_batch_samples
    return Reconstructor(engine, ReconstructorOptions(
        mini_batch_samples=mini_batch_samples,
        micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu, micro, micro),
        forward_micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu,
                                             critic.forward_micro_batch_size_per_gpu, micro),
        ppo_epochs=critic.ppo_epochs, shuffle=critic.shuffle, seed=cfg.trainer.seed))


def pool_roles(cfg: EmberConfig, placement: Placement) -> list[tuple[Pool, tuple[str, ...]]]:
    """Each pool that holds a role of this run, with the roles its processes build (actor and rollout
    together; the reference and critic beside them unless their own pool is elsewhere)."""
    wanted = {"actor": "actor_rollout", "reference": "ref", "critic": "critic"}
    if not uses_reference(cfg):
        wanted.pop("reference")
    if not uses_critic(cfg):
        wanted.pop("critic")
    by_pool: dict[Pool, list[str]] = {}
    for role, pool_role in wanted.items():
        pool = placement.pool_of(pool_role) if placement.split else placement.pools[0]
        by_pool.setdefault(pool, []).append(role)
    return [(pool, tuple(roles)) for pool, roles in by_pool.items()]


def build_worker_groups(cfg: EmberConfig, total_steps: int, use_ray: bool | None = None) -> dict[str, object]:
    """A worker group per pool of the run, keyed by role: in this process for a run of one device,
    Ray workers otherwise (one per GPU of each pool); `use_ray` forces either (benchmarks of Ray's cost)."""
    placement = plan_placement(cfg)
    layout = pool_roles(cfg, placement)
    if not (use_ray if use_ray is not None else world_size_of(cfg.trainer) > 1):
        (pool, roles), = layout
        group = LocalWorkerGroup(RankWorker, cfg, roles, total_steps, name=pool.name)
        return {role: group for role in roles}
    options = start_ray(cfg.ray_init, placement, wants_gpus=cfg.trainer.device != "cpu")
    groups = {}
    for pool, roles in layout:
        group = RayWorkerGroup(pool, RankWorker, cfg, roles, total_steps, options=options)
        groups.update({role: group for role in roles})
    return groups


def build_components(cfg: EmberConfig, use_ray: bool | None = None) -> RLComponents:
    """The driver's parts of the run; roles on Ray workers when the run has several GPUs (or `use_ray`)."""
    check_input_paths(cfg)
    # loaded once here, before any model, so that a wrong reward function stops the run at once
    reward_fn = resolve_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                  cfg.custom_reward_function.reward_kwargs, cfg.data.reward_fn or None,
                                  batched=cfg.reward_model.reward_manager == "batch")
    arr = cfg.actor_rollout_ref
    tokenizer = load_tokenizer(cfg)
    train_dataset = build_dataset(cfg.data.train_files, tokenizer, cfg)
    train_loader = PromptLoader(train_dataset, prompts_per_round(cfg), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    val_dataset = build_dataset(cfg.data.val_files, tokenizer, cfg) if cfg.data.val_files else None
    total_steps = total_training_steps(cfg, len(train_loader))
    groups = build_worker_groups(cfg, total_steps, use_ray)
    n = arr.rollout.n
    actor = ActorGroup(groups["actor"], mini_batch_samples=arr.actor.ppo_mini_batch_size * n,
                       ppo_epochs=arr.actor.ppo_epochs)
    reward = cfg.reward_model
    reward_manager = RewardManager(reward_fn, num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                                   failure_score=reward.failure_score, batched=reward.reward_manager == "batch")
    return RLComponents(tokenizer=tokenizer, train_loader=train_loader, val_dataset=val_dataset, actor=actor,
                        reference=ReferenceGroup(groups["reference"]) if "reference" in groups else None,
                        critic=CriticGroup(groups["critic"]) if "critic" in groups else None,
                        rollout=RolloutGroup(groups["actor"]), reward_manager=reward_manager,
                        eos_token_ids=stop_token_ids(arr.model.path, tokenizer), total_steps=total_steps,
                        timeline_file=cfg.ray_init.timeline_json_file, noise=run_noise_injection(cfg, total_steps))
