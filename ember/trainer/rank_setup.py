"""Builds what one process of a run holds, from the configuration: its engines (FSDP2 or Megatron), the
roles placed on it (`build_rank_roles`: actor and rollout, reference, critic or NLA's reconstructor) and
the pieces both sides read (the tokenizer and its stop tokens, the compute dtype, the device).

Each builder reads only its own config slice and hands plain options to the component, so the
components never see the whole configuration. The driver's side (data, pools, worker groups) is
`rl_setup.py`; a worker process builds its roles here (`rank_worker.py`).

The engines and the model loading (transformers' model classes, FSDP2, torch's compiler stack:
seconds of imports) are imported by the functions that build them: a driver whose ranks are Ray
workers imports them only where it builds a model itself (noise injection, LoRA's checks, a
resume's model check); `tests/unit/test_startup_imports.py`.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from ember.agent import AgentLoop, AgentOptions, load_tools
from ember.algorithms import ClipConfig
from ember.config import ConfigError
from ember.config.schema import EmberConfig
from ember.config.schema.rollout import STAND_IN_NAMES
from ember.distributed.device import current_device, device_type, rank, request_device
from ember.engines.base import MicroBatchSpec, TrainEngine
from ember.engines.lora import LoraOptions
from ember.engines.optim import OptimOptions
from ember.rollout import build_rollout
from ember.trainer.lora_setup import lora_options
from ember.trainer.metrics import timed
from ember.trainer.rollout_correction import bypass_correction
from ember.workers.actor import Actor, ActorOptions
from ember.workers.critic import Critic, CriticOptions
from ember.workers.noise_injection import NoiseInjection, build_noise_injection
from ember.workers.reconstructor import Reconstructor, ReconstructorOptions
from ember.workers.reference import Reference
from ember.workers.rollout import PolicyRollout
from ember.workers.weight_sync import WeightSender

if TYPE_CHECKING:
    from ember.inference.config import EngineConfig

logger = logging.getLogger(__name__)


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


def load_tokenizer(cfg: EmberConfig) -> PreTrainedTokenizerBase:
    model = cfg.actor_rollout_ref.model
    path = cfg.data.tokenizer or model.tokenizer_path or model.path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code or cfg.data.trust_remote_code)
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
                 compile_layers: bool = False, use_liger: bool = False, megatron=None, lora: LoraOptions | None = None,
                 **nla) -> TrainEngine:
    """The engine for `role`: Megatron when the role's `megatron` section is given (its strategy
    is megatron), else FSDP2. The speed switches come from wherever the caller's config keeps
    them (`*.model.use_remove_padding` in RL, top-level `use_remove_padding` in SFT; compiling
    from `actor.use_torch_compile`); the Megatron engine takes `use_remove_padding` alone (packed
    rows in megatron-core's THD format). `lora`: LoRA adapters (FSDP2 only; `trainer/lora_setup.py`). `nla`: NLA's
    options (injection_mode of the actor and the reference; output_layer_index and truncate_at_layer of a
    reconstructor), which both engines take."""
    if megatron is not None:
        from ember.engines.megatron.engine import MegatronEngine
        from ember.engines.megatron.options import megatron_options

        switches = (("use_fused_kernels", use_fused_kernels), ("use_torch_compile", compile_layers),
                    ("use_liger", use_liger))
        ignored = [name for name, on in switches if on]
        if ignored:
            logger.info("%s on strategy megatron: %s do not apply (its LM head fuses log-probs at TP = 1 anyway; "
                        "it compiles no layers and takes no Liger kernels)", role, ", ".join(ignored))
        if getattr(model_cfg, "override_config", None):
            logger.warning("%s on strategy megatron: model.override_config is not applied; set the fields in "
                           "megatron.override_model_config (HF config) or override_transformer_config", role)
        return MegatronEngine(megatron_options(model_path, role, megatron, optim, use_remove_padding, **nla))
    from ember.engines.fsdp.engine import EngineOptions, FSDPEngine

    return FSDPEngine(EngineOptions(
        model_path=model_path, role=role, model_dtype=fsdp_config.model_dtype,
        param_dtype=compute_dtype(model_cfg.dtype), attn_implementation=model_cfg.attn_implementation,
        enable_gradient_checkpointing=model_cfg.enable_gradient_checkpointing and role != "ref",
        use_remove_padding=use_remove_padding, use_fused_kernels=use_fused_kernels,
        reshard_after_forward=fsdp_config.reshard_after_forward, param_offload=fsdp_config.param_offload,
        optimizer_offload=fsdp_config.optimizer_offload, offload_policy=fsdp_config.offload_policy,
        full_determinism=fsdp_config.full_determinism, compile_layers=compile_layers, use_liger=use_liger, seed=seed,
        optim=optim or OptimOptions(),
        override_config=dict(getattr(model_cfg, "override_config", None) or {}),
        trust_remote_code=bool(getattr(model_cfg, "trust_remote_code", False)), lora=lora, **nla))


def run_noise_injection(cfg: EmberConfig, total_steps: int) -> NoiseInjection | None:
    """`trainer.noise_injection` resolved against the actor's architecture (an empty HF model of its
    config, so the weights' names and module types are the ones the weight stream carries)."""
    if not cfg.trainer.noise_injection.enabled:
        return None
    from ember.models.loading import build_model_on_meta, load_model_config

    model_cfg = cfg.actor_rollout_ref.model
    trust = model_cfg.trust_remote_code
    model = build_model_on_meta(load_model_config(model_cfg.path, trust_remote_code=trust), trust_remote_code=trust)
    return build_noise_injection(cfg.trainer.noise_injection, model, total_steps, cfg.trainer.seed)


def stand_in_note(rollout_cfg) -> str:
    """What a run with `rollout.name` vllm or sglang is told: ember's engine runs in its place, with
    the keys it honours, and the set keys it does not."""
    name = rollout_cfg.name
    ignored = [f"load_format={rollout_cfg.load_format}"] if rollout_cfg.load_format != "dummy_dtensor" else []
    ignored += [f"engine_kwargs.{name}.{key}" for key in sorted(rollout_cfg.engine_kwargs.get(name) or {})]
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
    from ember.inference.config import EngineConfig
    from ember.models.loading import resolve_dtype

    max_model_len = rollout.max_model_len or rollout.prompt_length + rollout.response_length
    budget = rollout.max_num_batched_tokens
    if not rollout.enable_chunked_prefill:  # then one step must hold a whole sequence
        budget = max(budget, max_model_len)
    return EngineConfig(max_model_len=max_model_len, max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=budget,
                        enable_chunked_prefill=rollout.enable_chunked_prefill,
                        gpu_memory_utilization=rollout.gpu_memory_utilization,
                        tensor_parallel_size=rollout.tensor_model_parallel_size,
                        dtype=resolve_dtype(compute_dtype(rollout.dtype)), device=str(current_device()),
                        use_cuda_graphs=not rollout.enforce_eager, quantization=rollout.quantization)


def import_external_libs(cfg: EmberConfig) -> None:
    """The modules `actor_rollout_ref.model.external_lib` and `critic.model.external_lib` name (custom models
    register themselves with transformers on import), in every process that loads a model."""
    for key, module in (("actor_rollout_ref.model.external_lib", cfg.actor_rollout_ref.model.external_lib),
                        ("critic.model.external_lib", cfg.critic.model.external_lib)):
        if module:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ConfigError(f"{key}={module} cannot be imported ({error}); install it or fix the name") from None


def build_agent_loop(rollout_cfg, rollout, tokenizer) -> AgentLoop | None:
    """rollout.multi_turn: the agent loop on the rollout's engine (ember's; validation refuses others), with the
    tools of its tool config; None when multi_turn is off."""
    multi_turn = rollout_cfg.multi_turn
    if not multi_turn.enable:
        return None
    options = AgentOptions(max_assistant_turns=multi_turn.max_assistant_turns, max_user_turns=multi_turn.max_user_turns,
                           max_parallel_calls=multi_turn.max_parallel_calls,
                           max_tool_response_length=multi_turn.max_tool_response_length,
                           tool_response_truncate_side=multi_turn.tool_response_truncate_side,
                           tool_timeout=multi_turn.tool_timeout)
    return AgentLoop(rollout.engine, tokenizer, load_tools(multi_turn.tool_config_path), options)


def build_rank_roles(cfg: EmberConfig, roles: tuple[str, ...], total_steps: int) -> dict[str, object]:
    """The roles one process holds (see `rank_worker.py`), each sized for its engine's data-parallel share
    (`rank_share`): "actor" (with "rollout" beside it, or with `hybrid_engine=false` the "weight_sender" that
    streams its weights to the rollout's own pool), "rollout" alone (that pool's ranks), "reference", "critic"."""
    import_external_libs(cfg)
    arr = cfg.actor_rollout_ref
    model_path = arr.model.path
    n = arr.rollout.n
    batch_samples = cfg.data.train_batch_size * n
    speed_switches = dict(use_remove_padding=arr.model.use_remove_padding,
                          use_fused_kernels=arr.model.use_fused_kernels, compile_layers=arr.actor.use_torch_compile,
                          use_liger=arr.model.use_liger)
    nla = getattr(cfg, "nla", None)  # an NLA run (`ember nla train`): vectors injected in the actor's forwards
    if nla is not None:
        speed_switches["injection_mode"] = nla.injection.mode
    built: dict[str, object] = {}
    seconds: dict[str, float] = {}  # each engine's build, for the start-up log
    if "actor" in roles:
        actor_cfg, rollout_cfg = arr.actor, arr.rollout
        actor_updates = optimizer_steps_per_rl_step(cfg, actor_cfg.ppo_epochs, actor_cfg.ppo_mini_batch_size)
        with timed(seconds, "actor"):
            actor_engine = build_engine(model_path, "actor", arr.model, actor_cfg.fsdp_config,
                                        optim_options(actor_cfg.optim, actor_cfg.grad_clip, total_steps, actor_updates),
                                        seed=cfg.trainer.seed, megatron=megatron_section(actor_cfg),
                                        lora=lora_options(arr.model, "actor_rollout_ref.model"), **speed_switches)
        mini_batch_samples = rank_share(actor_cfg.ppo_mini_batch_size * n, actor_engine,
                                        "actor_rollout_ref.actor.ppo_mini_batch_size × rollout.n")
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
            temperature=rollout_cfg.temperature, norm_length=norm_length(cfg), seed=cfg.trainer.seed,
            loss_scale=1 / n if nla is not None and nla.fork_actor_gradient_scale else 1.0,
            bypass=bypass_correction(cfg.algorithm.rollout_correction)))
        built["actor"] = actor
        if not arr.hybrid_engine:  # the rollout has its own pool: this pool's first rank sends it the weights
            built["weight_sender"] = WeightSender(actor, timeout_s=arr.nccl_timeout)
    if "reference" in roles:
        ref_cfg = arr.ref
        if arr.model.lora_rank:  # the base policy is the actor's module with its adapter off: no second copy
            engine = built["actor"].engine
        else:
            with timed(seconds, "reference"):
                engine = build_engine(model_path, "ref", arr.model, ref_cfg.fsdp_config, None, seed=cfg.trainer.seed,
                                      megatron=megatron_section(ref_cfg), **speed_switches)
        built["reference"] = Reference(engine, micro_batch_spec(
            ref_cfg.log_prob_use_dynamic_bsz, ref_cfg.log_prob_max_token_len_per_gpu,
            ref_cfg.log_prob_micro_batch_size_per_gpu, batch_samples), temperature=arr.rollout.temperature)
    if "critic" in roles and nla is not None:
        with timed(seconds, "reconstructor"):
            built["critic"] = build_reconstructor(cfg, total_steps)
    elif "critic" in roles:
        with timed(seconds, "critic"):
            built["critic"] = build_critic(cfg, total_steps)
    # param/optimizer_offload: on the device only in its phases (a LoRA reference shares the actor's engine).
    # Offloaded before the rollout engine is built, which sizes its KV cache by the memory free then: with the
    # training engines' memory off the device, as at every rollout (a 7B actor on one GPU with offload found
    # no room for a cache when it was built beside the actor's fp32 weights).
    engines = {id(built[role].engine): built[role].engine for role in ("actor", "reference", "critic") if role in built}
    for engine in engines.values():
        engine.offload()
    if "actor" in roles and arr.hybrid_engine:
        with timed(seconds, "rollout"):
            built["rollout"] = build_policy_rollout(cfg, total_steps, built["actor"])
    elif "rollout" in roles:  # hybrid_engine=false: the rollout pool's ranks
        with timed(seconds, "rollout"):
            built["rollout"] = build_policy_rollout(cfg, total_steps, None)
    logger.info("engines built on rank %d: %s", rank(),
                ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items()))
    return built


def build_policy_rollout(cfg: EmberConfig, total_steps: int, actor: Actor | None) -> PolicyRollout:
    """This rank's rollout role: beside `actor` in its process (hybrid engine), or on a rollout pool of its own
    (`actor` None: ember's engine, sent the weights by the actor's pool)."""
    arr = cfg.actor_rollout_ref
    rollout_cfg = arr.rollout
    tokenizer = load_tokenizer(cfg)
    name = rollout_cfg.engine
    if rollout_cfg.name in STAND_IN_NAMES:  # (NLA's nla_sglang says so in its own note)
        logger.warning(stand_in_note(rollout_cfg))
    actor_engine = actor.engine if actor is not None else None
    engine = build_rollout(name, actor_engine.module() if name == "hf" else None, tokenizer.pad_token_id,
                           max_batch_size=rollout_cfg.max_num_seqs, model_path=arr.model.path,
                           engine_config=engine_config(rollout_cfg) if name == "ember" else None)
    if actor is None:
        return PolicyRollout(engine, None, free_cache_engine=False, weight_timeout_s=arr.nccl_timeout)
    noise = run_noise_injection(cfg, total_steps)
    if name == "ember" and actor_engine.syncs_live_parameters and noise is None:
        engine.share_training_weights()  # the actor's tensors themselves become the engine's weights
    return PolicyRollout(engine, actor, free_cache_engine=rollout_cfg.free_cache_engine, noise=noise,
                         agent_loop=build_agent_loop(rollout_cfg, engine, tokenizer))


def rank_share(samples: int, engine: TrainEngine, what: str) -> int:
    """This rank's part of a mini-batch of `samples`: the engine's data-parallel size divides it (ranks of
    one tensor- or pipeline-parallel replica take the same samples, so the world size is not the divisor)."""
    if samples % engine.dp_size:
        raise ConfigError(f"{what} = {samples} samples per mini-batch do not split over the {engine.dp_size} "
                          "data-parallel ranks; choose a mini-batch size whose samples they divide")
    return samples // engine.dp_size


def norm_length(cfg: EmberConfig) -> float:
    """The actor's seq-mean-token-sum-norm divisor: `actor.loss_scale_factor`, else the padded response length."""
    factor = cfg.actor_rollout_ref.actor.loss_scale_factor
    return cfg.data.max_response_length if factor is None else factor


def build_critic(cfg: EmberConfig, total_steps: int) -> Critic:
    """This rank's PPO critic (value model), sized for its data-parallel share of the critic's batches."""
    critic = cfg.critic
    engine = critic_engine(cfg, "critic", total_steps)
    return Critic(engine, CriticOptions(
        **critic_batching(cfg, engine), cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode,
        norm_length=cfg.data.max_response_length))


def build_reconstructor(cfg: EmberConfig, total_steps: int) -> Reconstructor:
    """This rank's NLA reconstructor, sized for its data-parallel share of the critic's batches."""
    engine = critic_engine(cfg, "reconstructor", total_steps, output_layer_index=cfg.critic.output_layer_index,
                           truncate_at_layer=cfg.critic.model.truncate_at_layer)
    return Reconstructor(engine, ReconstructorOptions(**critic_batching(cfg, engine)))


def critic_engine(cfg: EmberConfig, role: str, total_steps: int, **nla) -> TrainEngine:
    """The engine of the `critic` section's model for `role` ("critic" or "reconstructor")."""
    critic = cfg.critic
    updates = optimizer_steps_per_rl_step(cfg, critic.ppo_epochs, critic.ppo_mini_batch_size)
    return build_engine(critic.model.path, role, critic.model, critic.model.fsdp_config,
                        optim_options(critic.optim, critic.grad_clip, total_steps, updates), seed=cfg.trainer.seed,
                        use_remove_padding=critic.model.use_remove_padding, megatron=megatron_section(critic), **nla)


def critic_batching(cfg: EmberConfig, engine: TrainEngine) -> dict:
    """The `critic` section's batching for this rank of `engine` (`CriticBatching`'s fields)."""
    critic = cfg.critic
    mini_batch_samples = rank_share(critic.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n, engine,
                                    "critic.ppo_mini_batch_size × rollout.n")
    micro = critic.ppo_micro_batch_size_per_gpu or mini_batch_samples
    return dict(mini_batch_samples=mini_batch_samples,
                micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu, micro, micro),
                forward_micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu,
                                                     critic.forward_micro_batch_size_per_gpu, micro),
                ppo_epochs=critic.ppo_epochs, shuffle=critic.shuffle, seed=cfg.trainer.seed)