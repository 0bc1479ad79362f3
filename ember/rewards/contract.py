"""The reward-function contract: what a reward function is given and what it may return.

A reward function is verl's ``compute_score``::

    fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None, **kwargs)
        -> float | dict

It returns a number, or a dict whose ``score`` is the reward and whose other numeric values
are per-sample metrics (non-numeric values, such as the extracted prediction, are ignored).
Functions are called with keyword arguments and receive only the contract arguments they
declare, so a scorer like ``gsm8k.compute_score(solution_str, ground_truth, method=...)``
is a valid reward function as it stands.
"""

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.errors import UserError

CONTRACT_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
REQUIRED_ARGUMENTS = ("solution_str", "ground_truth")


class RewardConfigError(UserError, ValueError):
    """The reward function cannot score this run as configured; the message says what to change
    (a `UserError`: the `ember` command prints it and exits with status 2).

    The reward manager re-raises it instead of scoring the sample as a failure: it means
    every sample would fail, not that one response was odd.
    """


@dataclass(frozen=True)
class RewardItem:
    """One response to score."""

    data_source: str  # the dataset the prompt came from; picks the built-in scorer
    solution_str: str  # the decoded response
    ground_truth: Any  # the reference answer, as stored in the dataset
    extra_info: dict | None = None  # any other per-sample fields from the dataset


class BoundRewardFn:
    """A reward function with its configured keyword arguments, checked once against the contract."""

    def __init__(self, fn: Callable, kwargs: dict, description: str):
        parameters = inspect.signature(fn).parameters
        accepts_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        keyword_names = {
            name
            for name, p in parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        missing = [n for n in REQUIRED_ARGUMENTS if n not in keyword_names and not accepts_any_keyword]
        if missing:
            raise RewardConfigError(
                f"reward function {description} must accept the keyword arguments {missing}; "
                f"its signature is {inspect.signature(fn)}, the contract is "
                "fn(data_source, solution_str, ground_truth, extra_info, **kwargs)"
            )
        unknown = [n for n in kwargs if n not in keyword_names and not accepts_any_keyword]
        clashing = [n for n in kwargs if n in CONTRACT_ARGUMENTS]
        if unknown or clashing:
            raise RewardConfigError(
                f"reward function {description} cannot take the configured keyword arguments "
                f"{unknown + clashing} (its signature is {inspect.signature(fn)}); remove them "
                "from custom_reward_function.reward_kwargs / data.reward_fn"
            )
        self.description = description
        self._fn = fn
        self._kwargs = dict(kwargs)
        self._passed_arguments = tuple(
            n for n in CONTRACT_ARGUMENTS if n in keyword_names or accepts_any_keyword
        )

    def __call__(self, item: RewardItem) -> float | dict:
        arguments = {name: getattr(item, name) for name in self._passed_arguments}
        return self._fn(**arguments, **self._kwargs)


BATCH_ARGUMENTS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class BatchRewardFn:
    """A batch reward function (verl's `batch` reward manager): called once per batch as
    ``fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...], **kwargs)``
    and returning one reward (a float or a dict with ``score``) per sample, in order."""

    def __init__(self, fn: Callable, kwargs: dict, description: str):
        parameters = inspect.signature(fn).parameters
        accepts_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        missing = [name for name in ("solution_strs", "ground_truths") if name not in parameters and not accepts_any_keyword]
        if missing:
            raise RewardConfigError(
                f"reward function {description} must accept the keyword arguments {missing} with "
                f"reward_model.reward_manager=batch; its signature is {inspect.signature(fn)}, the batch contract is "
                "fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list")
        self.description = description
        self._fn = fn
        self._kwargs = dict(kwargs)
        self._passed = tuple(name for name in BATCH_ARGUMENTS if name in parameters or accepts_any_keyword)

    def __call__(self, items: list[RewardItem]) -> list:
        columns = {"data_sources": [item.data_source for item in items],
                   "solution_strs": [item.solution_str for item in items],
                   "ground_truths": [item.ground_truth for item in items],
                   "extra_infos": [item.extra_info for item in items]}
        values = self._fn(**{name: columns[name] for name in self._passed}, **self._kwargs)
        if not isinstance(values, list | tuple) or len(values) != len(items):
            raise ValueError(f"batch reward function returned {type(values).__name__}"
                             f"{f' of length {len(values)}' if isinstance(values, list | tuple) else ''} for "
                             f"{len(items)} samples; return one reward per sample, in order")
        return list(values)


def split_reward_output(value) -> tuple[float, dict[str, float]]:
    """``(score, metrics)`` from a reward function's return value; TypeError/ValueError if invalid."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(
                f"reward function returned a dict without 'score' (keys: {sorted(value)}); "
                "put the reward under 'score'"
            )
        metrics = {
            key: float(metric)
            for key, metric in value.items()
            if key != "score" and isinstance(metric, numbers.Real)
        }
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function returned {type(value).__name__}; return a float or a dict with 'score'"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score ({score})")
    return score, metrics
