"""Loading a checkpoint into a run (resume) or an engine (export), so that a damaged checkpoint
is a clear error, or with `trainer.resume_mode=auto` a step back to the newest one that loads.

Every file a load reads is checked before anything is loaded: trainer_state.json parses and
has the loop's keys, rng_state.pt loads as plain tensors and numbers and each RNG state
restores, and each engine's files pass its `checkpoint_problem` (for FSDP: the DCP metadata
reads and every shard holds all the bytes the metadata lists, so a shard that is missing or
cut short anywhere is found from its size, without reading it). A copy cut short, a full
disk or a deleted file is refused there, before any engine is touched.

What sizes cannot show (bytes damaged in place) shows only while the engines load, when some
tensors may already hold the damaged checkpoint's values. Rather than read every shard twice
to rule that out, a load is made all-or-nothing by what a successful one does: it writes every
tensor of each engine's state (model, optimizer, schedule; DCP refuses a checkpoint that lacks
any of them), so loading the next checkpoint over a half-loaded engine leaves exactly that
checkpoint's state; the loop's own state (step, loader, RNG) is applied only after every engine
has loaded. The checks read the same files on every rank (a shared filesystem, as saving
needs) and DCP gathers read errors from all ranks, so the ranks fail and fall back together.

`auto` tries the checkpoints newest first and resumes from the first that loads, with a
warning naming each one skipped, why, and the one resumed from instead; when checkpoints exist
but none loads, the run stops with an error rather than start from scratch. `resume_path`
loads the checkpoint it names or stops with an error.

Whether a checkpoint was written for the model the run builds at all is checked before any work
(`run_folder.check_run_folder`) by `model_mismatch`: the tensors and shapes an FSDP checkpoint's
DCP metadata lists against those of the model built on the meta device as the engine builds it,
so that another architecture's checkpoint is refused by name rather than loaded key by key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from ember.engines.base import TrainEngine
from ember.engines.lora import LoraOptions, add_lora, is_adapter_name
from ember.trainer.checkpoint import CheckpointError, CheckpointManager, CheckpointProblem
from ember.trainer.run_state import SavedRunState, read_run_state

# ember.models.loading (transformers' model classes) and torch's distributed checkpointing (DTensor, sympy):
# seconds of imports, made by the functions below that build a model or load a checkpoint, which the driver of
# a fresh run does not call.

logger = logging.getLogger("ember.trainer")

Engines = list[tuple[str, TrainEngine]]
"""Each engine under its folder name in the checkpoint; anything with `checkpoint_problem` and `load`
does (the RL trainer passes its roles, which keep their engines resident while loading, on every rank)."""
# What a load of damaged bytes raises: DCP wraps each rank's error in a CheckpointException (a BaseException,
# which `load_engines` adds); torch.load and json raise the others.
_LOAD_ERRORS = (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from and its trainer_state.json values (the RNG is restored)."""

    path: str
    values: dict[str, Any]


def resume_from_checkpoint(checkpoints: CheckpointManager, resume_mode: str, resume_from_path: str | None,
                           engines: Engines, state_keys: Iterable[str], resident: bool = False) -> Resumed | None:
    """Loads the checkpoint `trainer.resume_mode` picks into `engines` and restores the RNG; None
    for a fresh start. `resident`: bring each engine onto the device for its load (`resident()`)."""
    candidates = checkpoints.resume_candidates(resume_mode, resume_from_path)
    skipped: list[tuple[str, CheckpointProblem]] = []
    for path in candidates:
        try:
            state = load_checkpoint(path, engines, state_keys, resident)
        except CheckpointProblem as problem:
            if resume_mode == "resume_path":
                raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}. Point trainer.resume_from_path "
                                      "at another global_step_N folder of the run, or set trainer.resume_mode=auto to "
                                      "resume from the newest one that loads") from None
            skipped.append((path, problem))
            continue
        for bad_path, problem in skipped:
            logger.warning("checkpoint %s cannot be loaded: %s; resuming from %s instead, the newest checkpoint that "
                           "loads", bad_path, problem, path)
        return Resumed(path, state.values)
    if skipped:
        listed = "".join(f"\n  - {path}: {problem}" for path, problem in skipped)
        raise CheckpointError(f"none of the {len(skipped)} checkpoint(s) in {checkpoints.root} can be loaded:{listed}\n"
                              "Repair or delete them, set trainer.default_local_dir to another folder, or set "
                              "trainer.resume_mode=disable with trainer.overwrite_default_local_dir=true to delete "
                              "them and start from scratch")
    return None


def load_checkpoint(path: str, engines: Engines, state_keys: Iterable[str], resident: bool = False) -> SavedRunState:
    """Checks every file of checkpoint `path`, loads the engines, then restores the RNG; raises
    CheckpointProblem naming the first bad file."""
    check_engine_files(path, engines)
    state = read_run_state(path, state_keys)
    load_engines(path, engines, resident)
    state.restore_rng()
    return state


def check_engine_files(path: str, engines: Engines) -> None:
    """Each engine's folder of checkpoint `path` as its `checkpoint_problem` sees it."""
    for name, engine in engines:
        folder = os.path.join(path, name)
        problem = engine.checkpoint_problem(folder) if os.path.isdir(folder) else f"{folder}/ is missing"
        if problem is not None:
            raise CheckpointProblem(problem)


def load_engines(path: str, engines: Engines, resident: bool = False) -> None:
    """`engine.load` of each engine's folder; a load that fails on damaged bytes becomes a CheckpointProblem."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ember.distributed.worker_group import WorkerError

    damage = (CheckpointException, *_LOAD_ERRORS)
    for name, engine in engines:
        folder = os.path.join(path, name)
        try:
            with engine.resident() if resident else contextlib.nullcontext():
                engine.load(folder)
        except torch.OutOfMemoryError:
            raise
        except damage as error:
            # a Ray worker's load (WorkerError) is damage only if the worker's own error is: not when its process
            # died (no cause), ran out of memory or failed otherwise
            cause = error.cause if isinstance(error, WorkerError) else error
            if not isinstance(cause, damage) or isinstance(cause, torch.OutOfMemoryError):
                raise
            raise CheckpointProblem(f"{folder} does not load although every file is there and long enough, so "
                                    f"bytes in it are damaged ({_first_failure(cause)})") from None


def _first_failure(error: BaseException) -> str:
    """A one-line account of `error`; for DCP's, of the first rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@dataclass(frozen=True)
class CheckpointedModel:
    """The model of one engine a checkpoint holds (the engine's folder in `global_step_N`), as the run builds
    it: from `path` (named by the config key `key`), with a value head for a critic, `overrides` being
    `model.override_config`."""

    folder: str
    key: str
    path: str
    value_head: bool = False
    overrides: dict[str, Any] | None = None
    trust_remote_code: bool = False
    lora: LoraOptions | None = None
    """With LoRA the engine's checkpoint holds the adapter's tensors alone (`FSDPEngine.save`)."""

    def config(self) -> PretrainedConfig:
        from ember.models.loading import load_model_config

        return load_model_config(self.path, value_head=self.value_head, overrides=self.overrides,
                                 trust_remote_code=self.trust_remote_code)

    @functools.cached_property
    def architecture(self) -> str:
        """The model's class as its config.json names it (e.g. Qwen2ForCausalLM)."""
        from ember.models.loading import load_model_config

        names = load_model_config(self.path, trust_remote_code=self.trust_remote_code).architectures
        return names[0] if names else "unknown architecture"

    @functools.cached_property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor of the model's state dict, as the FSDP engine saves it, with its full shape."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from ember.models.loading import build_model_on_meta

        model = build_model_on_meta(self.config(), value_head=self.value_head, trust_remote_code=self.trust_remote_code)
        if self.lora is None:
            return {name: tuple(tensor.shape) for name, tensor in get_model_state_dict(model).items()}
        add_lora(model, self.lora)
        return {name: tuple(tensor.shape) for name, tensor in get_model_state_dict(model).items()
                if is_adapter_name(name)}


def model_mismatch(folder: str, saved: dict[str, tuple[int, ...]], model: CheckpointedModel) -> str | None:
    """How the tensors an engine's checkpoint `folder` holds (`saved`: `dcp_folder.saved_tensor_shapes`) differ from
    those of the model the run builds (tensors only one of them has, shapes that differ; the first few), or
    None when they agree."""
    expected = model.tensor_shapes
    differences = [f"{name} is in the checkpoint, not in the model" for name in sorted(saved.keys() - expected.keys())]
    differences += [f"{name} is in the model, not in the checkpoint" for name in sorted(expected.keys() - saved.keys())]
    differences += [f"{name} is {list(saved[name])} in the checkpoint, {list(expected[name])} in the model"
                    for name in sorted(saved.keys() & expected.keys()) if saved[name] != expected[name]]
    if not differences:
        return None
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return f"{folder} does not fit {model.key}={model.path} ({model.architecture}): {'; '.join(differences[:3])}{more}"
