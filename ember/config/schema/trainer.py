"""The run itself (`trainer`): naming, GPUs, logging, checkpoints, validation cadence.

`RunConfig` holds what RL and SFT runs share; `TrainerConfig` adds the RL-only switches.
`default_local_dir` follows the project and experiment names through an interpolation.
"""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_, section

LoggerName = Literal["console", "tensorboard", "jsonl", "wandb", "mlflow"]
# Loggers whose package is an optional extra of ember, installed with `pip install 'ember[NAME]'`
# (NAME is also the package's import name); naming one that is not installed fails at load time.
LOGGERS_FROM_EXTRAS = ("wandb", "mlflow")
ResumeMode = Literal["auto", "disable", "resume_path"]
DeviceName = Literal["auto", "cuda", "npu", "cpu"]


@dataclass
class RunConfig:
    """Fields every training run has."""

    project_name: str = field_("ember", "project the run belongs to (names the checkpoint folder and loggers)")
    experiment_name: str = field_("default", "name of this run within the project")
    logger: list[LoggerName] = field_(
        ["console"], "metric sinks: console, tensorboard, jsonl, wandb, mlflow (a metrics.jsonl file is always written)")
    nnodes: int = field_(1, "machines in the run")
    n_gpus_per_node: int = field_(1, "GPUs used on each machine")
    device: DeviceName = field_("auto", "device type: auto = the machine's accelerator, else cpu")
    seed: int = field_(1, "seed of model initialisation and sampling")
    total_epochs: int = field_(30, "passes over the training data")
    total_training_steps: int | None = field_(None, "stop after this many steps; null = total_epochs worth of steps")
    save_freq: int = field_(-1, "save a checkpoint every this many steps; -1 = only at the end")
    test_freq: int = field_(-1, "validate every this many steps; -1 = never during training")
    max_loss_or_grad_norm: float = field_(
        1e8, "a loss or gradient norm (before clipping) above this makes a step bad, like a non-finite one: "
        "its weights are not checkpointed, and 3 bad steps in a row stop the run")
    resume_mode: ResumeMode = field_(
        "auto", "auto resumes from the latest checkpoint in default_local_dir, disable starts fresh, resume_path uses resume_from_path")
    resume_from_path: str | None = field_(None, "checkpoint folder to resume from when resume_mode is resume_path")
    default_local_dir: str = field_(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}", "where checkpoints and the resolved config are written")
    overwrite_default_local_dir: bool = field_(
        False, "let a fresh run (resume_mode=disable, auto with nothing to resume, or resume_path from another "
               "folder) replace the run whose checkpoints or metrics default_local_dir holds: they are deleted once "
               "the run has started; false = such a run is refused at start, the folder untouched")
    default_hdfs_dir: str | None = field_(
        None, "a folder each checkpoint is also copied to (local or mounted; hdfs:// and other URLs refused); null = none")


@dataclass
class NoiseInjectionConfig:
    """Adaptive noise injection (AQN): Gaussian noise on the rollout's copy of chosen weights, annealed
    over the run (ember/workers/noise_injection.py); the fork's keys and defaults."""

    enabled: bool = field_(False, "add noise to the rollout's weights (never to the actor's)")
    sigma_start: float = field_(0.01, "noise standard deviation of the first noisy stage")
    sigma_end: float = field_(0.001, "noise standard deviation of the last stage")
    num_stages: int = field_(10, "stages of the run: none in the first, then sigma decays geometrically; <= 1 = no noise")
    target_modules: list[str] | str = field_(
        ["post_attention_layernorm"], "module-name patterns that get noise (a JSON list in a string is read as a list)")
    exclude_patterns: list[str] | str = field_(
        ["input_layernorm"], "module-name patterns that never get noise (checked before target_modules)")
    layer_types: list[str] | str = field_(["rmsnorm"], "module types that can get noise: rmsnorm, linear")


@dataclass
class TrainerConfig(RunConfig):
    """An RL run: RunConfig plus validation, checkpoint retention and rollout dumps."""

    balance_batch: bool = field_(True, "reorder each batch so every data-parallel rank gets a similar number of tokens")
    log_val_generations: int = field_(0, "validation generations printed to the logger each validation")
    val_before_train: bool = field_(True, "validate once before the first training step")
    val_only: bool = field_(False, "validate and exit without training")
    critic_warmup: int = field_(0, "steps that train only the critic before the actor starts updating")
    del_local_ckpt_after_load: bool = field_(False, "delete the local checkpoint once it has been loaded")
    max_actor_ckpt_to_keep: int | None = field_(None, "actor checkpoints kept on disk; null = all")
    max_critic_ckpt_to_keep: int | None = field_(
        None, "verl's; ember keeps every role of a step in one global_step_N folder, so max_actor_ckpt_to_keep "
              "decides for the critic too (no effect)")
    rollout_data_dir: str | None = field_(
        None, "folder where each step's prompts, responses and rewards are dumped as jsonl; null = none")
    validation_data_dir: str | None = field_(None, "folder where validation generations are dumped as jsonl; null = none")
    noise_injection: NoiseInjectionConfig = section(NoiseInjectionConfig, "parameter noise in rollout weights")
