"""Builds the driver's parts of an RL run from its configuration: the checks a run makes before any
work, the datasets, the reward manager and a worker group per resource pool (`build_components`).
Each worker process then builds its own roles (`rank_setup.build_rank_roles`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import AutoConfig, PreTrainedTokenizerBase

from ember.agent import load_tools
from ember.config import ConfigError
from ember.config.schema import EmberConfig
from ember.data.prompt_loader import PromptLoader
from ember.data.rl_dataset import RLDataset
from ember.config.parallel import megatron_size_errors
from ember.config.parallel import world_size as world_size_of
from ember.config.placement import Placement, Pool, named_pool_note, plan_placement
from ember.distributed.ray_cluster import start_ray, write_timeline
from ember.distributed.worker_group import LocalWorkerGroup, RayWorkerGroup
from ember.rewards import RewardManager, resolve_reward_fn
from ember.rewards.contract import RewardConfigError
from ember.trainer.rank_setup import import_external_libs, load_tokenizer, run_noise_injection, stop_token_ids
from ember.trainer.lora_setup import check_lora_model, lora_options
from ember.trainer.rank_worker import RankWorker
from ember.trainer.resume import CheckpointedModel
from ember.trainer.experiment_trackers import check_tracker_login
from ember.trainer.model_folder import check_model_path, check_tokenizer, model_vocab_size
from ember.trainer.role_groups import ActorGroup, CriticGroup, ReferenceGroup, RolloutGroup, WeightSenderGroup
from ember.trainer.run_folder import check_run_folder
from ember.trainer.startup import StartUp
from ember.workers.noise_injection import NoiseInjection

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
    startup: StartUp = field(default_factory=StartUp)  # where the start-up went, logged with the first step

    def shutdown(self) -> None:
        """Write the Ray timeline when asked for one, then stop the worker processes of every pool (a
        no-op for roles in this process)."""
        groups = self.worker_groups()
        if self.timeline_file and any(isinstance(group, RayWorkerGroup) for group in groups):
            write_timeline(self.timeline_file)
        for group in groups:
            group.shutdown()

    def worker_groups(self) -> list:
        """The run's worker groups, each once (roles of one pool share one)."""
        groups = {id(role.group): role.group for role in (self.actor, self.rollout, self.reference, self.critic)
                  if role is not None}
        return list(groups.values())


def uses_critic(cfg: EmberConfig) -> bool:
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: EmberConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def check_override_config(key: str, model_path: str, overrides: dict, trust_remote_code: bool = False) -> None:
    """Each field `<key>.override_config` replaces must be one the model's config has (a typo would
    otherwise change nothing)."""
    if not overrides or not os.path.isdir(model_path):
        return
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    unknown = sorted(name for name in overrides if not hasattr(config, name))
    if unknown:
        raise ConfigError(f"{key}.override_config sets {', '.join(unknown)}, which the model's config "
                          f"({type(config).__name__}, {model_path}) does not have; override fields it has "
                          "(e.g. attention_dropout, or output_router_logits for a MoE model)")


def check_megatron_sizes(key: str, model_path: str | None, megatron, trust_remote_code: bool = False) -> None:
    """The Megatron sizes of the section at `key` against the model's heads, layers and experts (a size
    megatron-core cannot split the model by stops the run now, naming the sizes that would)."""
    if megatron is None or model_path is None or not os.path.isdir(model_path):
        return
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    overrides = megatron.override_model_config or {}
    for name, value in dict(overrides.get("model_config", overrides) or {}).items():  # what the engine builds from
        setattr(config, name, value)
    heads = config.num_attention_heads
    experts = next((getattr(config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, name, None)), None)
    errors = megatron_size_errors(key, megatron, heads, getattr(config, "num_key_value_heads", None) or heads,
                                  config.num_hidden_layers, experts)
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "\n  - ".join(["invalid Megatron sizes:", *errors]))


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


def tensorboard_environment_dir(loggers) -> dict[str, str]:
    """`$TENSORBOARD_DIR` as an output folder of a run that writes TensorBoard events there
    (`loggers.tensorboard_dir`; without it they go under trainer.default_local_dir)."""
    path = os.environ.get("TENSORBOARD_DIR")
    return {"TENSORBOARD_DIR (environment)": path} if path and "tensorboard" in loggers else {}


def check_input_paths(cfg: EmberConfig) -> None:
    """Stops a run before any work when a model, tokenizer, data file, reward file or
    checkpoint it names does not exist, or an output folder (checkpoints, dumps, traces, TensorBoard) cannot be
    written, naming the key to change;
    or when its resume or fresh start would lose another run's work (`run_folder.check_run_folder`)."""
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
            check_model_path(key, path, trust_remote_code=arr.model.trust_remote_code if key.startswith("actor")
                             else cfg.critic.model.trust_remote_code)
    check_override_config("actor_rollout_ref.model", arr.model.path, arr.model.override_config,
                          arr.model.trust_remote_code)
    check_lora_model(lora_options(arr.model, "actor_rollout_ref.model"), arr.model.path, arr.model.trust_remote_code)
    if uses_critic(cfg) and cfg.critic.model.path is not None:
        check_override_config("critic.model", cfg.critic.model.path, cfg.critic.model.override_config,
                              cfg.critic.model.trust_remote_code)
    for key, section in {"actor_rollout_ref.actor": arr.actor, "actor_rollout_ref.ref": arr.ref}.items():
        if section.strategy == "megatron" and (key.endswith("actor") or uses_reference(cfg)):
            check_megatron_sizes(f"{key}.megatron", arr.model.path, section.megatron, arr.model.trust_remote_code)
    if uses_critic(cfg) and cfg.critic.strategy == "megatron":
        check_megatron_sizes("critic.megatron", cfg.critic.model.path, cfg.critic.megatron,
                             cfg.critic.model.trust_remote_code)
    tokenizers = {"actor_rollout_ref.model.path": arr.model.path, "actor_rollout_ref.model.tokenizer_path":
                  arr.model.tokenizer_path, "data.tokenizer": cfg.data.tokenizer}
    for key, path in list(tokenizers.items())[1:]:
        if path is not None:
            check_model_path(key, path, tokenizer_only=True)
    key, path = [(key, path) for key, path in tokenizers.items() if path is not None][-1]  # load_tokenizer's pick
    remote_code = arr.model.trust_remote_code or cfg.data.trust_remote_code
    check_tokenizer(key, path, model_vocab_size(arr.model.path, arr.model.trust_remote_code),
                    "actor_rollout_ref.model.path", remote_code)
    check_data_files("custom_reward_function.path", cfg.custom_reward_function.path)
    check_data_files("data.train_files", cfg.data.train_files)
    check_data_files("data.val_files", cfg.data.val_files)
    profiler = cfg.global_profiler
    outputs = {"trainer.default_local_dir": cfg.trainer.default_local_dir,
               "trainer.default_hdfs_dir": cfg.trainer.default_hdfs_dir,
               "trainer.rollout_data_dir": cfg.trainer.rollout_data_dir,
               "trainer.validation_data_dir": cfg.trainer.validation_data_dir,
               "global_profiler.save_path": (profiler.save_path if profiler.tool == "torch_memory" or
                                             (profiler.tool and profiler.steps) else None),
               **tensorboard_environment_dir(cfg.trainer.logger)}
    for key, path in outputs.items():
        if path:
            check_output_dir(key, path)
    check_tracker_login(cfg.trainer.logger)
    check_run_folder(cfg.trainer, checkpointed_models(cfg))


def checkpointed_models(cfg: EmberConfig) -> list[CheckpointedModel]:
    """The models a checkpoint of this run holds, the policy first, as a resume checks them: the actor and a
    PPO critic (NLA's reconstructor, cut after a layer, is not checked)."""
    model, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    models = [CheckpointedModel("actor", "actor_rollout_ref.model.path", model.path, overrides=model.override_config,
                                trust_remote_code=model.trust_remote_code,
                                lora=lora_options(model, "actor_rollout_ref.model"))]
    if uses_critic(cfg) and getattr(cfg, "nla", None) is None and critic.path is not None:
        models.append(CheckpointedModel("critic", "critic.model.path", critic.path, value_head=True,
                                        overrides=critic.override_config, trust_remote_code=critic.trust_remote_code))
    return models


def build_dataset(files, tokenizer, cfg: EmberConfig, tool_schemas: list[dict] | None = None,
                  max_samples: int = -1) -> RLDataset:
    """The prompts of `files` (`max_samples` of their rows: data.train_max_samples / val_max_samples); with
    `tool_schemas` (multi-turn) the chat template renders the tools into each prompt, as verl's agent loop does
    (`apply_chat_template(..., tools=...)`)."""
    data = cfg.data
    return RLDataset(files, tokenizer, prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                     filter_overlong_prompts=data.filter_overlong_prompts, truncation=data.truncation,
                     return_raw_chat=data.return_raw_chat, reward_fn_key=data.reward_fn_key,
                     apply_chat_template_kwargs={"tools": tool_schemas} if tool_schemas else None,
                     max_samples=max_samples, sample_seed=data.seed if data.shuffle else None)


def tool_schemas(cfg: EmberConfig) -> list[dict] | None:
    """rollout.multi_turn: the schemas of the configured tools (loading them here stops a bad tool config before
    any model is built); None when multi_turn is off."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return None
    return [tool.get_openai_tool_schema() for tool in load_tools(multi_turn.tool_config_path).values()]


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


def total_training_steps(cfg: EmberConfig, steps_per_epoch: int) -> int:
    return cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs


def warn_overridden_settings(cfg: EmberConfig, total_steps: int) -> None:
    """Logs each verl key the user set that ember replaces with its own value, so that setting it does not
    seem to have worked: the optimizer's step count (the schedule spans the run's `total_steps`, as verl
    overwrites the key) and a checkpoint without the optimizer (ember always saves it, for exact resumes); and
    where verl would run another loss than ember for the same keys (bypass mode with a policy loss other than
    vanilla PPO)."""
    sections = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor}
    if uses_critic(cfg):
        sections["critic"] = cfg.critic
    for path, section in sections.items():
        steps = section.optim.total_training_steps
        if steps != -1 and steps != total_steps:
            logger.warning("%s.optim.total_training_steps=%d is ignored: the learning-rate schedule spans the run's "
                           "%d steps (trainer.total_training_steps, else total_epochs × steps per epoch), as verl "
                           "fills it in; remove the key or set trainer.total_training_steps", path, steps, total_steps)
        if "optimizer" not in section.checkpoint.save_contents:
            logger.warning("%s.checkpoint.save_contents=%s leaves out optimizer, but ember saves the optimizer "
                           "state anyway: resuming from a checkpoint continues the run exactly only with it",
                           path, list(section.checkpoint.save_contents))
    correction, loss_mode = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if correction.bypass_mode and correction.loss_type == "ppo_clip" and loss_mode != "vanilla":
        logger.warning("algorithm.rollout_correction.bypass_mode with actor.policy_loss.loss_mode=%s: ember trains "
                       "with %s against the rollout's log-probs, as configured; verl's bypass mode replaces the loss "
                       "mode by token-level PPO (vanilla) there, so its curves of this config are vanilla PPO's",
                       loss_mode, loss_mode)


def pool_roles(cfg: EmberConfig, placement: Placement) -> list[tuple[Pool, tuple[str, ...]]]:
    """Each pool that holds a role of this run, with the roles its processes build (actor and rollout
    together, unless `hybrid_engine=false` gives the rollout its own pool; the reference and critic beside
    them unless their own pool is elsewhere)."""
    # A LoRA reference is the actor's module with the adapter off: it lives in the actor's processes.
    wanted = {"actor": "actor_rollout", "reference": "actor_rollout" if cfg.actor_rollout_ref.model.lora_rank else "ref",
              "critic": "critic"}
    if not uses_reference(cfg):
        wanted.pop("reference")
    if not uses_critic(cfg):
        wanted.pop("critic")
    if not cfg.actor_rollout_ref.hybrid_engine:
        wanted["rollout"] = "rollout"
    by_pool: dict[Pool, list[str]] = {}
    for role, pool_role in wanted.items():
        pool = placement.pool_of(pool_role) if placement.split else placement.pools[0]
        by_pool.setdefault(pool, []).append(role)
    return [(pool, tuple(roles)) for pool, roles in by_pool.items()]


def check_built_in_reward_sources(datasets: dict[str, RLDataset | None]) -> None:
    """With the built-in reward function, every data_source of the run's files needs a built-in scorer: checked when
    they load, not at the first batch that draws a row of an unknown source (hours in, or at the first validation)."""
    from ember.rewards.routing import unknown_sources, unknown_sources_message  # its scorers import math_verify

    for key, dataset in datasets.items():
        unknown = unknown_sources(sample.data_source for sample in dataset.samples) if dataset is not None else []
        if unknown:
            raise RewardConfigError(f"{key}: {unknown_sources_message(unknown)}")


def build_worker_groups(cfg: EmberConfig, total_steps: int, use_ray: bool | None = None) -> dict[str, object]:
    """A worker group per pool of the run, keyed by role: in this process for a run of one device,
    Ray workers otherwise (one per GPU of each pool); `use_ray` forces either (benchmarks of Ray's cost)."""
    placement = plan_placement(cfg)
    note = named_pool_note(cfg)  # where the NLA fork's pools place the run otherwise than the fork itself
    if note:
        logger.warning(note)
    layout = pool_roles(cfg, placement)
    if use_ray is False and world_size_of(cfg.trainer) > 1:
        raise ValueError(f"a run of {world_size_of(cfg.trainer)} GPUs has its ranks in Ray workers; use_ray=False "
                         "would run one rank in this process")
    separate_rollout = not cfg.actor_rollout_ref.hybrid_engine
    if use_ray is False and separate_rollout:
        raise ValueError("a rollout pool of its own (hybrid_engine=false) runs in Ray workers; use_ray=False "
                         "would put it in this process")
    if not (use_ray if use_ray is not None else world_size_of(cfg.trainer) > 1 or separate_rollout):
        (pool, roles), = layout
        group = LocalWorkerGroup(RankWorker, cfg, roles, total_steps, name=pool.name)
        return {role: group for role in roles}
    options = start_ray(cfg.ray_init, placement, wants_gpus=cfg.trainer.device != "cpu")
    groups = {}
    for pool, roles in layout:  # each pool's workers start building at once: split pools build side by side
        group = RayWorkerGroup(pool, RankWorker, cfg, roles, total_steps, options=options)
        groups.update({role: group for role in roles})
    for group in {id(group): group for group in groups.values()}.values():
        group.wait_until_built()
    return groups


def build_rollout_group(groups: dict[str, object]) -> RolloutGroup:
    """The rollout as the trainer drives it: beside the actor, or (`hybrid_engine=false`) on its own pool,
    joined to the actor's first rank by the weight group."""
    if groups.get("rollout", groups["actor"]) is groups["actor"]:
        return RolloutGroup(groups["actor"])
    return RolloutGroup(groups["rollout"], sender=WeightSenderGroup(groups["actor"]))


def build_components(cfg: EmberConfig, use_ray: bool | None = None) -> RLComponents:
    """The driver's parts of the run; roles on Ray workers when the run has several GPUs (or `use_ray`)."""
    startup = StartUp()
    check_input_paths(cfg)
    import_external_libs(cfg)
    # loaded once here, before any model, so that a wrong reward function stops the run at once
    with startup.phase("rewards"):
        reward_fn = resolve_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                      cfg.custom_reward_function.reward_kwargs, cfg.data.reward_fn or None,
                                      batched=cfg.reward_model.reward_manager == "batch")
    arr = cfg.actor_rollout_ref
    with startup.phase("data"):
        tokenizer = load_tokenizer(cfg)
        tools = tool_schemas(cfg)
        train_dataset = build_dataset(cfg.data.train_files, tokenizer, cfg, tools, cfg.data.train_max_samples)
        train_loader = PromptLoader(train_dataset, prompts_per_round(cfg), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        val_dataset = (build_dataset(cfg.data.val_files, tokenizer, cfg, tools, cfg.data.val_max_samples)
                       if cfg.data.val_files else None)
        if not (cfg.custom_reward_function.path or cfg.data.reward_fn):
            check_built_in_reward_sources({"data.train_files": train_dataset, "data.val_files": val_dataset})
    total_steps = total_training_steps(cfg, len(train_loader))
    warn_overridden_settings(cfg, total_steps)
    with startup.phase("roles"):
        groups = build_worker_groups(cfg, total_steps, use_ray)
    n = arr.rollout.n
    actor = ActorGroup(groups["actor"], mini_batch_samples=arr.actor.ppo_mini_batch_size * n,
                       ppo_epochs=arr.actor.ppo_epochs)
    reward = cfg.reward_model
    with startup.phase("rewards"):
        reward_manager = RewardManager(reward_fn, num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                                       failure_score=reward.failure_score, batched=reward.reward_manager == "batch")
    return RLComponents(tokenizer=tokenizer, train_loader=train_loader, val_dataset=val_dataset, actor=actor,
                        reference=ReferenceGroup(groups["reference"]) if "reference" in groups else None,
                        critic=CriticGroup(groups["critic"]) if "critic" in groups else None,
                        rollout=build_rollout_group(groups),
                        reward_manager=reward_manager,
                        eos_token_ids=stop_token_ids(arr.model.path, tokenizer), total_steps=total_steps,
                        timeline_file=cfg.ray_init.timeline_json_file, noise=run_noise_injection(cfg, total_steps),
                        startup=startup)
