"""verl's keys that ember's schema has no field for: accepted as verl writes them, noted or refused otherwise.

verl's own config folder (`ppo_trainer.yaml`, `sft_trainer.yaml` and their groups `actor/`,
`optim/`, `engine/`, ...), and the NLA fork's copy of it, set every key verl knows. A user
pointing `--config-path` at such a folder composes all of them. The one thing to know: a key
listed here is taken off the configuration as it arrives (ember/config/tree.py), and what
happens then depends only on its value:

- verl's default (what verl does without the key, which is what ember does): accepted quietly;
- another value of a `VerlKey` that ember simply does not use: accepted, and named once in one
  warning when loading ends ("no effect", with the reason);
- another value of a `refuse=True` key, where ember would silently run something other than
  what verl runs: an error naming the key and what to write instead.

`_target_` (the dataclass Hydra would instantiate) is accepted anywhere the schema has no
such key. A key in neither place is still an unknown key, reported with the file it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANY = object()  # a VerlKey default: every value is accepted quietly


@dataclass(frozen=True)
class VerlKey:
    """A key of verl's (or the NLA fork's) config files without an ember field.

    `default` is verl's default: for a mapping-valued key, a mapping of the entries that
    matter (others are ignored), compared entry by entry; an empty mapping when every entry matters."""

    reason: str
    default: Any = ANY
    refuse: bool = False

    def departures(self, value: Any) -> Any:
        """What of `value` departs from verl's default (None when nothing does). A `${...}` value follows the key
        it points at, which is checked where it is written."""
        return _departures(self.default, value)


def _departures(default: Any, value: Any) -> Any:
    """`VerlKey.departures` for `default`: a tuple of defaults takes any of them; a mapping default compares the
    entries it names (nested mappings alike), other entries of `value` being free."""
    if default is ANY or _points_elsewhere(value):
        return None
    if isinstance(default, tuple):
        return None if value in default else value
    if isinstance(default, dict) and isinstance(value, dict):
        if not default:  # an empty mapping by default: any entry departs from it
            return value or None
        differing = {name: value[name] for name, wanted in default.items()
                     if name in value and _departures(wanted, value[name]) is not None}
        return differing or None
    return None if value == default else value


def _points_elsewhere(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def _under(prefixes: tuple[str, ...], entries: dict[str, VerlKey]) -> dict[str, VerlKey]:
    return {f"{prefix}.{name}": entry for prefix in prefixes for name, entry in entries.items()}


_NEW_WORKERS = "read by verl's new engine workers only (use_legacy_worker_impl); ember reads the role's own key"
_PROFILER = VerlKey("verl's per-role profiler (nsys/npu/torch_memory); ember profiles with global_profiler",
                    {"enable": False})
_FSDP_ENGINE = {
    "forward_only": VerlKey(_NEW_WORKERS, False),
    "strategy": VerlKey(_NEW_WORKERS + " (its strategy)"),
    "use_orig_params": VerlKey("ember's FSDP2 always keeps the original parameters", False),
    "seed": VerlKey("every role is seeded from trainer.seed"),
    "use_torch_compile": VerlKey(_NEW_WORKERS + " (actor.use_torch_compile)", True),
    "entropy_checkpointing": VerlKey(_NEW_WORKERS, False),
    "entropy_from_logits_with_chunking": VerlKey(_NEW_WORKERS, False),
    "ulysses_sequence_parallel_size": VerlKey(_NEW_WORKERS + " (the role's ulysses_sequence_parallel_size)", 1),
    "mixed_precision": VerlKey("ember computes in fsdp_config.model_dtype and reduces in fp32",
                               {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}),
    "dtype": VerlKey(_NEW_WORKERS + " (the model's compute dtype: actor_rollout_ref.model.dtype)", "bfloat16"),
}
_MEGATRON_OPTIM = {
    "clip_grad": VerlKey(_NEW_WORKERS + " (grad_clip)", 1.0),
    "optimizer": VerlKey("ember's optimizer is Adam(W)", ("adam", "AdamW"), refuse=True),  # Megatron's, FSDP's
    "lr_decay_style": VerlKey("set optim.lr_scheduler_type (constant or cosine) instead", "constant", refuse=True),
    "lr_decay_steps": VerlKey("the schedule runs over the whole run", None, refuse=True),
    "lr_warmup_init": VerlKey("warm-up starts from 0", 0.0, refuse=True),
    "min_lr": VerlKey("set optim.min_lr_ratio instead", 0.0, refuse=True),
    "lr_wsd_decay_steps": VerlKey("WSD schedules only (lr_decay_style WSD, refused)"),
    "lr_wsd_decay_style": VerlKey("WSD schedules only (lr_decay_style WSD, refused)"),
    "weight_decay_incr_style": VerlKey("weight decay stays constant", "constant", refuse=True),
    "override_optimizer_config": VerlKey(  # noted, not refused: the fork's 30B file asks for CPU optimizer offload
        "megatron-core optimizer fields are not passed through: ember's optimizer keeps fp32 state on the GPU "
        "(use optimizer_offload to move it to CPU between steps)", {}),
    "use_checkpoint_opt_param_scheduler": VerlKey("the schedule is ember's own, saved with the checkpoint", False),
}
_ROLE = {
    "profiler": _PROFILER,
    "checkpoint.async_save": VerlKey("checkpoints are written synchronously", False),
    "load_weight": VerlKey("weights are always loaded from model.path", True, refuse=True),
    "data_loader_seed": VerlKey("the data order follows trainer.seed"),
    "nccl_timeout": VerlKey("the roles' collectives follow actor_rollout_ref.nccl_timeout", 600),
    "megatron.forward_only": VerlKey(_NEW_WORKERS, False),
    "megatron.dtype": VerlKey(_NEW_WORKERS + " (the model's compute dtype: actor_rollout_ref.model.dtype)",
                              "bfloat16"),
    "megatron.dist_checkpointing_prefix": VerlKey("dist_checkpointing_path's files are read as they are named", ""),
    "megatron.use_remove_padding": VerlKey("the Megatron engine packs sequences as actor_rollout_ref.model."
                                           "use_remove_padding (critic.model.use_remove_padding) says", True),
    "megatron.vanilla_mbridge": VerlKey("ember converts between Hugging Face and Megatron weights with mbridge's "
                                        "layouts itself", True),
    "entropy_checkpointing": VerlKey("entropy is computed from detached logits unless the loss needs it", False),
    "entropy_from_logits_with_chunking": VerlKey("entropy is computed with the log-probs", False),
    "rollout_n": VerlKey("ember reads actor_rollout_ref.rollout.n"),
    "router_replay": VerlKey("MoE routing replay (the rollout's expert choices replayed in training) is not in ember; "
                             "remove it", {"mode": "disabled"}, refuse=True),
}
_TILED_MLP = VerlKey("verl's tiled MLP (the MLP's activations computed in shards to save memory) is not in ember; "
                     "recompute (enable_gradient_checkpointing) saves activation memory", {"enabled": False})
_REWARD_CLASS = "a custom reward manager / reward loop class is not loaded: reward_model.reward_manager decides"

_NOT_VERL_DEFAULT = object()  # a default no value equals: every value given is refused
_FULLY_ASYNC = VerlKey("verl's fully async trainer streams samples one by one and counts its run in samples; ember's "
                       "async_training.mode=fully_async generates whole steps' batches ahead and counts steps "
                       "(trainer.total_training_steps, data.train_batch_size, trainer.test_freq): remove the key",
                       _NOT_VERL_DEFAULT, refuse=True)

RL_VERL_KEYS: dict[str, VerlKey] = {
    "async_training.use_rollout_log_probs": VerlKey(
        "the rollout's log-probs as the old ones is algorithm.rollout_correction.bypass_mode=true in ember", False,
        refuse=True),
    "async_training.compute_prox_log_prob": VerlKey(
        "a proximal log-prob forward is not built; algorithm.rollout_correction (decoupled mode) computes the old "
        "log-probs with the trainer's weights", False, refuse=True),
    "async_training.use_trainer_do_validate": VerlKey("validation runs on the rollout pool", False, refuse=True),
    "async_training.checkpoint_engine": VerlKey(
        "ember always sends the weights over its own torch.distributed group in buckets"),
    **{f"rollout.{name}": _FULLY_ASYNC for name in ("n", "total_rollout_steps", "total_epochs", "test_freq")},
    "actor_rollout_ref.actor.use_rollout_log_probs": VerlKey(
        "the rollout's log-probs as the old ones is algorithm.rollout_correction.bypass_mode in ember", False,
        refuse=True),
    "trainer.weight_sync_with_ray": VerlKey(
        "ember sends the weights over a torch.distributed group (NCCL, gloo on the CPU) between the actor's first "
        "rank and the rollout ranks, in buckets, whatever this says", True),
    **_under(("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config",
              "critic.model.fsdp_config", "reward_model.model.fsdp_config"), _FSDP_ENGINE),
    **_under(("actor_rollout_ref.actor.optim", "critic.optim"), _MEGATRON_OPTIM),
    **_under(("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"), _ROLE),
    "actor_rollout_ref.actor.freeze_vision_tower": VerlKey("ember trains text models only", False, refuse=True),
    "actor_rollout_ref.actor.tis_imp_ratio_cap": VerlKey(
        "truncated importance sampling is not in ember; remove it", -1, refuse=True),
    "actor_rollout_ref.actor.use_fused_kernels": VerlKey(
        "write actor_rollout_ref.model.use_fused_kernels (ember's actor and reference read it)",
        "${oc.select:actor_rollout_ref.model.use_fused_kernels,false}", refuse=True),
    "actor_rollout_ref.actor.use_remove_padding": VerlKey(
        "write actor_rollout_ref.model.use_remove_padding (ember's actor and reference read it)",
        "${oc.select:actor_rollout_ref.model.use_remove_padding,false}", refuse=True),
    "actor_rollout_ref.ref.use_torch_compile": VerlKey(
        "ember's reference compiles when actor_rollout_ref.actor.use_torch_compile does",
        "${oc.select:actor_rollout_ref.actor.use_torch_compile,true}", refuse=True),
    "actor_rollout_ref.ref.model": VerlKey("the reference is actor_rollout_ref.model", None, refuse=True),
    "actor_rollout_ref.model.custom_chat_template": VerlKey("set data.chat_template instead", None, refuse=True),
    "actor_rollout_ref.model.hf_config_path": VerlKey("the model's config.json is read from model.path", None,
                                                      refuse=True),
    "actor_rollout_ref.model.use_shm": VerlKey("models are read in place", False),
    "actor_rollout_ref.rollout.layered_summon": VerlKey(
        "ember's weight sync always gathers a bucket of layers at a time (about 512 MiB), and with LoRA sends only "
        "the adapted layers, merged", False),
    "actor_rollout_ref.model.fused_kernel_options": VerlKey("ember's fused log-probs have one implementation"),
    "actor_rollout_ref.rollout.agent": VerlKey(
        "verl's agent-loop workers and servers (num_workers, default_agent_loop, custom_async_server: no effect); "
        "ember's agent loop (rollout.multi_turn) runs in each rollout worker on its own engine, and a custom agent "
        "loop class (agent_loop_config_path) is not loaded",
        {"agent_loop_config_path": None}, refuse=True),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": VerlKey(
        "interactions (a simulated user answering the model) are not in ember; tools only", None, refuse=True),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": VerlKey(
        "ember renders only each new tool turn with the model's chat template and never re-renders the history",
        False),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": VerlKey(
        "ember never re-tokenises the history (each turn's tokens are appended as sampled), so there is nothing to "
        "check"),
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": VerlKey("rollout.n samples each prompt", None),
    "actor_rollout_ref.rollout.trace": VerlKey("rollout tracing (weave, mlflow) is not in ember", {"backend": None}),
    "actor_rollout_ref.rollout.profiler": _PROFILER,
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": VerlKey(
        "ember's engine captures a graph per padded batch size itself", None),
    "actor_rollout_ref.rollout.disable_log_stats": VerlKey("vLLM's statistics log", True),
    "actor_rollout_ref.rollout.enable_prefix_caching": VerlKey(
        "ember's engine shares a prompt's prefill among its own rollout.n samples", True),
    "actor_rollout_ref.rollout.multi_stage_wake_up": VerlKey("ember wakes its engine in one stage", False),
    "actor_rollout_ref.rollout.over_sample_rate": VerlKey(
        "verl's older SGLang rollout aborted the last over_sample_rate of requests (its newer code reads the key "
        "nowhere); ember generates every request to its end", 0),
    "actor_rollout_ref.rollout.skip_rollout": VerlKey("rollouts are always generated", False, refuse=True),
    "actor_rollout_ref.rollout.skip_dump_dir": VerlKey("skip_rollout only (refused)"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": VerlKey("ember's engine takes token ids", True),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": VerlKey("ember sizes its own weight buckets", 512),
    "actor_rollout_ref.rollout.layer_name_map": VerlKey("vLLM's Megatron weight names; ember maps its own"),
    "actor_rollout_ref.rollout.quantization_config_file": VerlKey(
        "a vLLM quantization config file (e.g. FP8 block sizes); ember's rollout.quantization=fp8 has one scale per "
        "output channel and reads no file", None, refuse=True),
    "algorithm.use_pf_ppo": VerlKey("PF-PPO's reweighting is not in ember", False, refuse=True),
    "algorithm.pf_ppo": VerlKey("use_pf_ppo only (refused)"),
    "algorithm.rollout_correction.rollout_token_veto_threshold": VerlKey(
        "older verl's per-token veto, which verl replaced (January 2026, #4544) by the rejection options "
        "seq_max_k2/seq_max_k3: write algorithm.rollout_correction.rollout_rs=seq_max_k2 and rollout_rs_threshold",
        None, refuse=True),
    "critic.forward_micro_batch_size": VerlKey(
        "write critic.forward_micro_batch_size_per_gpu", "${oc.select:.ppo_micro_batch_size,null}", refuse=True),
    "critic.rollout_n": VerlKey("ember reads actor_rollout_ref.rollout.n"),
    "critic.model.lora_rank": VerlKey("the critic trains all its weights", 0, refuse=True),
    "critic.model.lora_alpha": VerlKey("critic LoRA only (lora_rank, refused)"),
    "critic.model.target_modules": VerlKey("critic LoRA only (lora_rank, refused)"),
    "critic.model.use_shm": VerlKey("models are read in place", False),
    "data.use_shm": VerlKey("files are read in place", False),
    "data.apply_chat_template_kwargs": VerlKey("the chat template gets no extra arguments", {}, refuse=True),
    "data.datagen": VerlKey("dynamic data generation is not in ember", {"path": None}, refuse=True),
    "data.sampler": VerlKey("a custom sampler class is not in ember", {"class_path": None}, refuse=True),
    "data.image_key": VerlKey("ember reads text only"),
    "data.video_key": VerlKey("ember reads text only"),
    "data.return_multi_modal_inputs": VerlKey("ember reads text only"),
    "data.validation_shuffle": VerlKey("validation data is read in order", False),
    "global_profiler.global_tool_config.nsys": VerlKey("Nsight Systems options; ember profiles with torch.profiler"),
    "global_profiler.global_tool_config.torch_memory.stack_depth": VerlKey(
        "torch's recorder keeps whole stacks (torch.cuda.memory._record_memory_history takes no depth)", 32),
    "global_profiler.global_tool_config.torch_memory.kw_args": VerlKey("verl's code reads it nowhere", {}),
    "reward_model.enable_resource_pool": VerlKey("the reward model runs in the roles' pool", False, refuse=True),
    "reward_model.n_gpus_per_node": VerlKey("enable_resource_pool only (refused)", 0),
    "reward_model.nnodes": VerlKey("enable_resource_pool only (refused)", 0),
    "reward_model.profiler": _PROFILER,
    "reward_model.sandbox_fusion": VerlKey("sandbox code execution is not in ember", {"url": None}, refuse=True),
    "reward_model.ulysses_sequence_parallel_size": VerlKey("the reward model runs without sequence parallelism", 1,
                                                           refuse=True),
    "reward_model.load_weight": VerlKey("weights are always loaded from model.path", True, refuse=True),
    "reward_model.nccl_timeout": VerlKey("collectives follow actor_rollout_ref.nccl_timeout", 600),
    "reward_model.megatron": VerlKey("ember's reward model runs on FSDP2"),
    "reward_model.model.use_shm": VerlKey("models are read in place", False),
    "reward_model.model.use_fused_kernels": VerlKey("the reward model computes scores, not log-probs"),
    "trainer.esi_redundant_time": VerlKey("elastic-server-instance expiry (verl's ESI saving)", 0),
    "trainer.ray_wait_register_center_timeout": VerlKey("ember's workers register with no center", 300),
    "trainer.use_legacy_worker_impl": VerlKey("ember has one worker implementation"),
    # keys of verl's config as of early 2026 (b178a3cd), accepted as verl writes them
    **{f"{role}.optim.optimizer_impl": VerlKey("ember's optimizer is torch.optim's AdamW", "torch.optim", refuse=True)
       for role in ("actor_rollout_ref.actor", "critic")},
    "actor_rollout_ref.actor.tau_pos": VerlKey("SAPO's (policy_loss.loss_mode=sapo, not in ember)", 1.0),
    "actor_rollout_ref.actor.tau_neg": VerlKey("SAPO's (policy_loss.loss_mode=sapo, not in ember)", 1.05),
    "actor_rollout_ref.actor.calculate_entropy": VerlKey(
        "ember always logs the actor's entropy (from detached logits unless the loss has an entropy term)", False),
    "actor_rollout_ref.actor.use_prefix_grouper": VerlKey(
        "a forward shared by the samples of one prompt is not in ember (each sample's forward is whole)", False),
    "actor_rollout_ref.actor.calculate_sum_pi_squared": VerlKey("the Σπ² metric is not in ember", False),
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing": VerlKey("the Σπ² metric is not in ember", False),
    **{f"actor_rollout_ref.rollout.{name}": VerlKey(
        "ember's rollout splits a model by tensor_model_parallel_size (a MoE model's experts too): set that instead",
        1, refuse=True) for name in ("expert_parallel_size", "pipeline_model_parallel_size")},
    "actor_rollout_ref.rollout.logprobs_mode": VerlKey(
        "ember's rollout records the log-probs of log_softmax(logits / temperature)", "processed_logprobs",
        refuse=True),
    "actor_rollout_ref.rollout.scheduling_policy": VerlKey("ember's engine schedules first come, first served",
                                                           "fcfs", refuse=True),
    "actor_rollout_ref.rollout.checkpoint_engine": VerlKey(
        "ember always sends the weights over its own torch.distributed group in buckets"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": VerlKey(
        "MoE routing replay is not in ember; remove it", False, refuse=True),
    "actor_rollout_ref.rollout.prometheus": VerlKey("vLLM's Prometheus endpoint; ember logs its rollout's metrics "
                                                    "with the run's", {"enable": False}),
    "actor_rollout_ref.rollout.mtp": VerlKey("follows actor_rollout_ref.model.mtp"),
    "actor_rollout_ref.model.mtp": VerlKey("multi-token prediction (its training loss and speculative rollout) is "
                                           "not in ember; remove it", {"enable": False}, refuse=True),
    "actor_rollout_ref.model.tiled_mlp": _TILED_MLP,
    **{f"{model}.lora": VerlKey(f"verl's Megatron LoRA block: write {model}.lora_rank, lora_alpha and target_modules",
                                {"rank": 0}, refuse=True)
       for model in ("actor_rollout_ref.model", "critic.model")},
    "critic.model.tiled_mlp": _TILED_MLP,
    "data.tool_config_path": VerlKey("ember reads actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    "data.image_patch_size": VerlKey("ember reads text only"),
    "reward_manager": VerlKey(_REWARD_CLASS, {"source": "register", "module": {"path": None,
                                                                              "name": "custom_reward_manager"}},
                              refuse=True),
    "reward_model.reward_loop_source": VerlKey(_REWARD_CLASS, "register", refuse=True),
    "reward_model.reward_loop_module_path": VerlKey(_REWARD_CLASS, None, refuse=True),
    "reward_model.reward_loop_class_name": VerlKey(_REWARD_CLASS, None, refuse=True),
    "reward_model.model.override_config": VerlKey("the reward model is built as its config.json says", {},
                                                  refuse=True),
    "reward_model.use_reward_loop": VerlKey("ember scores rewards in its own worker processes "
                                            "(reward_model.num_workers)"),
    "reward_model.rollout": VerlKey("a generative reward model served by a rollout engine is not in ember; "
                                    "verl reads it only for such a model"),
    "transfer_queue.enable": VerlKey("verl's TransferQueue data path; ember hands batches to its workers itself",
                                     False),
}

# The NLA fork's own keys that nothing in the fork reads (its base file, nla_grpo_full.yaml, and older run files).
NLA_FORK_KEYS: dict[str, VerlKey] = {
    **{f"trainer.{name}": VerlKey("the fork's base file sets it; nothing in the fork reads it")
       for name in ("worker_module", "use_tensorboard", "checkpoint", "gradient_checkpointing", "clip_ratio",
                    "value_clip", "max_grad_norm", "normalize_reward", "normalize_advantages", "gamma", "lam")},
    "actor_rollout_ref.ref.enable": VerlKey(
        "the fork's; the reference exists when use_kl_loss or use_kl_in_reward asks for it", False),
    "algorithm.kl_ctrl.value": VerlKey("the fork's; verl reads algorithm.kl_ctrl.kl_coef"),
    "data.micro_batch_size_per_gpu": VerlKey("the fork's; the actor's and critic's micro-batch keys decide"),
    "data.num_workers": VerlKey("the fork's; ember reads data.dataloader_num_workers"),
    "data.valid_num_workers": VerlKey("the fork's; read by nothing"),
    "data.eval_batch_size": VerlKey("the fork's; read by nothing (nla_eval has its own)"),
    "data.response_key": VerlKey("RL rows have no response"),
    "nla.grpo": VerlKey("the fork's; read by nothing (rollout.n and the actor's keys decide)"),
    "nla.use_nla_datasets": VerlKey("the fork's; NLA rows are always read as NLA rows"),
    "critic.output_activation_vectors": VerlKey("the fork's older files; the reconstructor always predicts vectors"),
    "critic.use_vector_value_head": VerlKey("the fork's older files; the reconstructor has no value head"),
    "critic.vector_output_dim": VerlKey("the fork's older files; the vector size is the model's hidden size"),
    "ray_init.runtime_env": VerlKey("ember's Ray workers take the driver's environment: set variables there", {}),
}

SFT_VERL_KEYS: dict[str, VerlKey] = {
    "data.micro_batch_size": VerlKey("verl's deprecated global size, read by nothing; data.micro_batch_size_per_gpu "
                                     "decides", None),
    "data.balance_dp_token": VerlKey("ember's SFT batches split by examples", False, refuse=True),
    "data.prompt_dict_keys": VerlKey("prompts are read from prompt_key as they are", None, refuse=True),
    "data.response_dict_keys": VerlKey("responses are read from response_key as they are", None, refuse=True),
    "data.multiturn.enable_thinking_key": VerlKey("a column of per-row enable_thinking flags is not read",
                                                  "enable_thinking"),
    "data.use_shm": VerlKey("files are read in place", False),
    "data.apply_chat_template_kwargs": VerlKey("the chat template gets no extra arguments", {}, refuse=True),
    "model.use_shm": VerlKey("models are read in place", False),
    "trainer.checkpoint": VerlKey("ember sft's checkpoints hold the model, the optimizer and the run state",
                                  {"save_contents": ["model", "optimizer", "extra"]}),
}
