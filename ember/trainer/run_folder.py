"""Who may write in a run folder (`trainer.default_local_dir`), so that no run loses another's work.

A run either continues the run in its folder (it resumes from one of the folder's checkpoints) or
starts fresh there. Nothing in the folder is rewritten or deleted before that is settled:

- before any work, on every rank (`check_run_folder`): a checkpoint to resume from must have been
  written for the model this run builds (the tensors of its DCP metadata against the model's,
  `resume.model_mismatch`, and the architecture of the model its run's config.yaml names against
  this run's), and a fresh start (`resume_mode=disable`, `auto` with no checkpoint, `resume_path`
  from another folder) needs a folder that holds no other run's checkpoints or metrics, unless
  `trainer.overwrite_default_local_dir` says to replace that run. Either refusal names the folder
  and the ways out;
- once the checkpoint has loaded (`claim_run_folder`, on rank 0): a fresh start deletes the
  previous run's checkpoints and metrics (overwrite only); a resume sets the folder's checkpoints
  newer than the one it loaded aside (`set_aside_later_checkpoints`: they are another line of the
  run, whose metrics after that step the run drops and logs again); and the run's config.yaml is
  written, so that a refused resume leaves the config.yaml that `ember export` reads for the old
  checkpoints.

Pruning (keep-N) then deletes only the run's own checkpoints (`CheckpointManager`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from ember.config import ConfigError
from ember.config.schema.trainer import RunConfig
from ember.config.yaml_io import read_yaml_file
from ember.trainer.checkpoint import (STEP_DIR, TRACKER_FILE, CheckpointError, CheckpointManager, check_resume_path,
                                     list_checkpoints)
from ember.trainer.resume import CheckpointedModel, model_mismatch

logger = logging.getLogger("ember.trainer")

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
OVERWRITE_KEY = "trainer.overwrite_default_local_dir"


def check_run_folder(trainer: RunConfig, models: list[CheckpointedModel]) -> None:
    """Refuses, before any work, a resume of a checkpoint written for another model than `models` (the run's
    checkpointed engines, its policy first) and a fresh start into a folder another run has trained in
    (see the module docstring). `trainer`: the run's `trainer` section."""
    run_dir = trainer.default_local_dir
    if trainer.resume_mode == "resume_path":
        check_resume_path(trainer.resume_from_path)
        candidates = [os.path.normpath(trainer.resume_from_path)]
    elif trainer.resume_mode == "auto":
        candidates = [path for _, path in reversed(list_checkpoints(run_dir))]
    else:
        candidates = []
    for checkpoint in candidates:
        if _fits(checkpoint, models, trainer):
            break
    if candidates and in_folder(candidates[0], run_dir):
        return
    reason = (f"it resumes from {candidates[0]}, outside the folder" if candidates
              else "trainer.resume_mode=disable" if trainer.resume_mode == "disable" else "nothing to resume")
    check_fresh_start(run_dir, trainer.overwrite_default_local_dir, reason)


def claim_run_folder(checkpoints: CheckpointManager, resumed_from: str | None, overwrite: bool,
                     config_yaml: str) -> None:
    """Once the run knows where it starts (`resumed_from`: the checkpoint it loaded, or None): a run that continues
    the folder's run owns its checkpoints up to the one it resumed from; a fresh one deletes what a previous run left
    (only with `overwrite`; refused otherwise). Rank 0 then writes the resolved config (`config_yaml`)."""
    run_dir = checkpoints.root
    if resumed_from is not None and in_folder(resumed_from, run_dir):
        step = int(STEP_DIR.match(os.path.basename(os.path.normpath(resumed_from))).group(1))
        checkpoints.resumed_at(step)
        if checkpoints.is_writer:
            set_aside_later_checkpoints(run_dir, step)
    elif checkpoints.is_writer:
        check_fresh_start(run_dir, overwrite, "nothing resumed from this folder")
        delete_previous_run(run_dir)
    if checkpoints.is_writer:
        os.makedirs(run_dir, exist_ok=True)
        temporary = os.path.join(run_dir, f".{CONFIG_FILE}.tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(config_yaml)
        os.replace(temporary, os.path.join(run_dir, CONFIG_FILE))


def set_aside_later_checkpoints(run_dir: str, step: int) -> None:
    """Moves the checkpoints of `run_dir` newer than `step`, the one the run resumed from (an older one named by
    `trainer.resume_from_path`, or the newest that loads under `auto`), into `superseded_after_step_<step>/`: the
    run goes on from `step`, and a later `resume_mode=auto` must not take up the abandoned line from them. Nothing
    is deleted (`ember export` reads them there, beside a copy of the config.yaml they were written with); the
    newest-step record is set back to `step`."""
    later = [path for saved, path in list_checkpoints(run_dir) if saved > step]
    if not later:
        return
    aside = os.path.join(run_dir, f"superseded_after_step_{step}")
    suffix = 1
    while os.path.exists(aside):  # resumed from this step before
        suffix += 1
        aside = os.path.join(run_dir, f"superseded_after_step_{step}_{suffix}")
    os.makedirs(aside)
    config = os.path.join(run_dir, CONFIG_FILE)
    if os.path.isfile(config):  # the config they were written with, which `ember export` reads beside them
        shutil.copy2(config, os.path.join(aside, CONFIG_FILE))
    moved = []
    for path in later:
        moved.append(os.path.join(aside, os.path.basename(path)))
        os.replace(path, moved[-1])
    with open(os.path.join(run_dir, TRACKER_FILE), "w", encoding="utf-8") as handle:
        handle.write(str(step))
    logger.warning("resumed from step %d of %s: its later checkpoints (%s) are set aside in %s, so that a later "
                   "trainer.resume_mode=auto goes on from this run's own line", step, run_dir,
                   ", ".join(os.path.basename(path) for path in moved), aside)


def check_fresh_start(run_dir: str, overwrite: bool, reason: str) -> None:
    """A run that starts fresh in `run_dir` (`reason` says why it does) needs a folder without another run's
    checkpoints or metrics, unless `overwrite`."""
    if overwrite:
        return
    steps = [step for step, _ in list_checkpoints(run_dir)]
    if steps:
        held = f"global_step_{steps[0]}" + (f" to global_step_{steps[-1]}" if len(steps) > 1 else "")
        metrics = f" and the {METRICS_FILE}" if has_metrics(run_dir) else ""
        raise ConfigError(f"trainer.default_local_dir={run_dir} holds the checkpoints ({held}){metrics} of another "
                          f"run, and this run starts fresh ({reason}). Resume that run with trainer.resume_mode=auto, "
                          f"set trainer.default_local_dir to another folder, or set {OVERWRITE_KEY}=true to delete "
                          "them and start afresh there")
    if has_metrics(run_dir):
        raise ConfigError(f"trainer.default_local_dir={run_dir} holds the {METRICS_FILE} of a run that wrote no "
                          f"checkpoint, and this run starts fresh ({reason}). Set trainer.default_local_dir to another "
                          f"folder, or set {OVERWRITE_KEY}=true to replace that run's metrics")


def has_metrics(run_dir: str) -> bool:
    """Whether `run_dir`'s metrics.jsonl holds a record (an empty one is what a run that logged nothing left)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as handle:
        return any(line.strip() for line in handle)


def delete_previous_run(run_dir: str) -> None:
    """Deletes the checkpoints (finished or not), the newest-step record and the metrics a previous run left."""
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        path = os.path.join(run_dir, name)
        unfinished = name.removeprefix(".").removesuffix(".tmp")  # `.global_step_N.tmp`, a save cut short
        if os.path.isdir(path) and (STEP_DIR.match(name) or STEP_DIR.match(unfinished)):
            shutil.rmtree(path)
        elif name in (TRACKER_FILE, METRICS_FILE):
            os.remove(path)


def in_folder(checkpoint: str, run_dir: str) -> bool:
    """Whether `checkpoint` (a global_step_N folder) is one of `run_dir`'s."""
    return os.path.realpath(os.path.dirname(os.path.normpath(checkpoint))) == os.path.realpath(run_dir)


def _fits(checkpoint: str, models: list[CheckpointedModel], trainer: RunConfig) -> bool:
    """Whether `checkpoint` was seen to be written for `models` (False: its tensors could not be read, and
    resume.py's checks report why when it loads); raises CheckpointError when it was written for another model."""
    from ember.engines.dcp_folder import saved_tensor_shapes  # torch's DCP: imported when there is a checkpoint

    mismatches, seen = [], False
    for model in models:
        folder = os.path.join(checkpoint, model.folder)
        saved = saved_tensor_shapes(os.path.join(folder, "model"))  # FSDP's layout; None for Megatron's
        seen = seen or saved is not None
        if saved is not None and (mismatch := model_mismatch(folder, saved, model)):
            mismatches.append(mismatch)
    recorded = recorded_model(os.path.dirname(os.path.normpath(checkpoint)))
    if recorded is not None and (mismatches or (models and recorded[1] not in (None, models[0].architecture))):
        mismatches.append(f"the run that wrote {checkpoint} trained {recorded[0]} "
                          f"({recorded[1] or 'architecture unknown'}), and {models[0].key}={models[0].path} is a "
                          f"{models[0].architecture}")
    if not mismatches:
        return seen
    details = "; ".join(mismatches)
    if trainer.resume_mode == "resume_path":
        raise CheckpointError(f"trainer.resume_from_path={checkpoint} is a checkpoint of another model: {details}. "
                              "Point trainer.resume_from_path at a checkpoint of this model, or set "
                              "trainer.resume_mode=disable to start from the model itself")
    raise CheckpointError(f"trainer.default_local_dir={trainer.default_local_dir} holds a run of another model: "
                          f"{details}. To train this model, set trainer.default_local_dir to another folder, or set "
                          f"trainer.resume_mode=disable and {OVERWRITE_KEY}=true to delete that run's checkpoints "
                          "and metrics and start afresh there")


def recorded_model(run_dir: str) -> tuple[str, str | None] | None:
    """(the policy's model path, its architecture when that path is a local model folder) as `run_dir`'s
    config.yaml names them (`ember train`'s actor_rollout_ref.model.path, `ember sft`'s model.partial_pretrain);
    None without a readable config.yaml naming one."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    sections = read_yaml_file(path)
    sections = sections if isinstance(sections, dict) else {}
    if "actor_rollout_ref" in sections:
        model_path = ((sections["actor_rollout_ref"] or {}).get("model") or {}).get("path")
    else:
        model_path = (sections.get("model") or {}).get("partial_pretrain")
    if not isinstance(model_path, str):
        return None
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return model_path, None
    with open(config_file, encoding="utf-8") as handle:
        architectures = json.load(handle).get("architectures") or [None]
    return model_path, architectures[0]
