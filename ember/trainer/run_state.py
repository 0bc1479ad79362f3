"""The part of a checkpoint that belongs to the loop rather than an engine: the step, the
data-loader position, the KL coefficient, validation history and every RNG state, so that a
resumed run continues exactly where the saved one would have.

`rng_state.pt` holds only tensors, numbers, strings and containers, so it is read with
`torch.load(weights_only=True)`: a checkpoint from elsewhere cannot run code when loaded.
Python's Mersenne Twister state is kept as its list of ints, numpy's as a tensor of its
624 words; both go back bit for bit. Files written by older ember versions pickled numpy's
state as objects and are refused rather than unpickled.

Reading (`read_run_state`) checks both files completely, RNG states included, before a
resume loads anything; `SavedRunState.restore_rng` applies them once everything has loaded.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ember.trainer.checkpoint import STEP_DIR, CheckpointProblem

STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pt"
RNG_FORMAT = 2  # 1 (unnumbered): pickled tuples and numpy arrays, refused since it needs weights_only=False


def save_run_state(directory: str, **state) -> None:
    with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2)
    torch.save(_current_rng_state(), os.path.join(directory, RNG_FILE))


@dataclass(frozen=True)
class SavedRunState:
    """A checkpoint's loop state, read and checked: `values` from trainer_state.json, and the RNG
    states from rng_state.pt in the form their generators take them, not applied yet."""

    values: dict[str, Any]
    python_rng: tuple
    numpy_rng: tuple
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None

    def restore_rng(self) -> None:
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda_rng)


def read_run_state(directory: str, keys: Iterable[str]) -> SavedRunState:
    """Both files of `directory`, checked: trainer_state.json must be a JSON object with `keys`,
    rng_state.pt a safely loadable RNG state this version writes. Raises CheckpointProblem."""
    return SavedRunState(_read_values(os.path.join(directory, STATE_FILE), keys),
                         *_read_rng_state(os.path.join(directory, RNG_FILE)))


def _read_values(path: str, keys: Iterable[str]) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointProblem(f"{path} is missing")
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointProblem(f"{path} is not valid JSON, it is cut short or damaged ({error})") from None
    missing = [key for key in keys if not isinstance(values, dict) or key not in values]
    if missing:
        raise CheckpointProblem(f"{path} lacks {', '.join(missing)}; it was not written by this run's trainer")
    for key, value in values.items():
        problem = _VALUE_PROBLEMS[key](value) if key in _VALUE_PROBLEMS else None
        if problem:
            raise CheckpointProblem(f"{path} has {key}={json.dumps(value)[:80]}, {problem}; it was not written by "
                                    "ember's trainer or was edited")
    folder = STEP_DIR.match(os.path.basename(os.path.normpath(os.path.dirname(path))))
    if folder and "step" in values and values["step"] != int(folder.group(1)):
        raise CheckpointProblem(f"{path} has step={values['step']} but sits in {folder.group(0)}; it was copied from "
                                "another checkpoint or edited")
    return values


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _validation_entry(item: Any) -> bool:
    return (isinstance(item, list) and len(item) == 2 and _is_count(item[0]) and isinstance(item[1], dict)
            and all(_is_number(value) for value in item[1].values()))


# What each value of trainer_state.json must be (None: fine), checked before a resume loads anything.
_VALUE_PROBLEMS = {
    "step": lambda value: None if _is_count(value) else "not a step count (an integer from 0)",
    "loader": lambda value: None if isinstance(value, dict) and all(_is_count(item) for item in value.values())
    else "not a loader position (an object of integers from 0)",
    "kl_coef": lambda value: None if _is_number(value) else "not a finite number",
    "validation_history": lambda value: None if isinstance(value, list) and all(map(_validation_entry, value))
    else "not a list of [step, {metric: number}] pairs",
}


def _current_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    rng = {"format": RNG_FORMAT,
           "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
           "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _read_rng_state(path: str) -> tuple[tuple, tuple, torch.Tensor, list[torch.Tensor] | None]:
    """The Python, numpy, torch and CUDA states of `path`, each tried on a scratch generator."""
    if not os.path.isfile(path):
        raise CheckpointProblem(f"{path} is missing")
    try:
        rng = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointProblem(f"{path} holds pickled Python objects (the format of ember before RNG format "
                                f"{RNG_FORMAT}), which are not loaded since unpickling can run code from the "
                                "file") from None
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointProblem(f"{path} does not load, it is cut short or damaged ({error})") from None
    if not isinstance(rng, dict) or rng.get("format") != RNG_FORMAT:
        raise CheckpointProblem(f"{path} is not an RNG state of format {RNG_FORMAT}, the one this ember writes")
    try:
        python = rng["python"]
        python_rng = (python["version"], tuple(python["internal"]), python["gauss_next"])
        random.Random().setstate(python_rng)
        numpy = rng["numpy"]
        numpy_rng = ("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                     numpy["cached_gaussian"])
        np.random.RandomState().set_state(numpy_rng)
        torch.Generator().set_state(rng["torch"])
        cuda_rng = rng.get("cuda")
        if cuda_rng is not None and not all(isinstance(state, torch.Tensor) for state in cuda_rng):
            raise TypeError("the CUDA states are not tensors")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise CheckpointProblem(f"{path} holds an RNG state that does not restore ({type(error).__name__}: "
                                f"{error})") from None
    return python_rng, numpy_rng, rng["torch"], cuda_rng
