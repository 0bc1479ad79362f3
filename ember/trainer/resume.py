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
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ember.engines.base import TrainEngine
from ember.trainer.checkpoint import CheckpointError, CheckpointManager, CheckpointProblem
from ember.trainer.run_state import SavedRunState, read_run_state

logger = logging.getLogger("ember.trainer")

Engines = list[tuple[str, TrainEngine]]
"""Each engine under its folder name in the checkpoint; anything with `checkpoint_problem` and `load`
does (the RL trainer passes its roles, which keep their engines resident while loading, on every rank)."""
# What a load of damaged bytes raises: DCP wraps each rank's error in a CheckpointException
# (a BaseException); torch.load and json raise the others.
_LOAD_ERRORS = (CheckpointException, RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError)


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
                              "Repair or delete them, or set trainer.resume_mode=disable to start from scratch")
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
    for name, engine in engines:
        folder = os.path.join(path, name)
        try:
            with engine.resident() if resident else contextlib.nullcontext():
                engine.load(folder)
        except torch.OutOfMemoryError:
            raise
        except _LOAD_ERRORS as error:
            raise CheckpointProblem(f"{folder} does not load although every file is there and long enough, so "
                                    f"bytes in it are damaged ({_first_failure(error)})") from None


def _first_failure(error: BaseException) -> str:
    """A one-line account of `error`; for DCP's, of the first rank's own error."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
