"""Score a batch of responses with the run's reward function, without letting it stop the run.

``RewardManager.score(items)`` returns one score per item, in input order, plus per-sample
metrics from functions that return dicts. A function that raises, returns something that is
not a reward, crashes its process or runs past ``timeout_s`` gives that sample
``failure_score``; the failure is counted (``num_errors`` / ``num_timeouts``) and logged once
per kind of failure, with its traceback, on the ``ember.rewards`` logger. A
``RewardConfigError`` (say, a data_source no built-in scorer knows) is raised instead, since
every sample would fail; so is one when every item of a call with ``stop_if_none_scored``
(a training step's) failed: training on nothing but ``failure_score`` teaches nothing.

With ``batched`` (verl's ``batch`` reward manager) the function is called once per batch with
lists, in the calling process. With ``num_workers >= 1`` the items are scored in worker processes that live as long as the
manager (see ``pool.py``). With ``num_workers=0`` they are scored in the calling process:
no start-up cost and easy debugging, but no timeout, since a running Python call cannot be
interrupted from outside its process.
"""

import logging
import math
from dataclasses import dataclass

from ember.rewards.contract import RewardConfigError, RewardItem
from ember.rewards.pool import ItemOutcome, WorkerPool, score_batch, score_item
from ember.rewards.registry import RewardFnSpec

logger = logging.getLogger("ember.rewards")


@dataclass
class RewardResult:
    """Scores of one batch, in input order, and what went wrong while computing them."""

    scores: list[float]  # one reward per item; failure_score where scoring failed
    extras: dict[str, list[float]]  # per-item metrics from dict returns; nan where absent
    num_errors: int  # items whose function raised, returned an invalid value or crashed
    num_timeouts: int  # items whose function ran past timeout_s


class RewardManager:
    """Scores batches of ``RewardItem`` with one reward function, reusing its workers."""

    def __init__(
        self,
        spec: RewardFnSpec,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        failure_score: float = 0.0,
        batched: bool = False,
    ):
        """`batched`: one call per batch with lists (verl's `batch` reward manager), in this process
        (no timeout); an exception fails every sample of the batch, counted and logged once."""
        if num_workers < 0:
            raise ValueError(f"reward num_workers must be >= 0 (0 scores in-process), got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0 seconds, got {timeout_s}")
        self.spec = spec
        self.failure_score = failure_score
        self._batch_fn = spec.load(batched=True) if batched else None
        self._pool = WorkerPool(spec, num_workers, timeout_s) if num_workers and not batched else None
        self._in_process_fn = None if num_workers or batched else spec.load()
        self._logged_failures: set[tuple] = set()
        self._closed = False

    def score(self, items: list[RewardItem], stop_if_none_scored: bool = False) -> RewardResult:
        """Score ``items``; see the module docstring for what happens on failure. With
        `stop_if_none_scored`, a RewardConfigError naming the function and the first failure when
        every item failed."""
        if self._closed:
            raise RuntimeError("this RewardManager is closed; create a new one to score more")
        if self._batch_fn is not None:
            outcomes = score_batch(self._batch_fn, items)
        elif self._pool is not None:
            outcomes = self._pool.score(items)
        else:
            outcomes = [score_item(self._in_process_fn, item) for item in items]
        for outcome in outcomes:
            if outcome.failure is not None:
                self._log_once(outcome)
        if stop_if_none_scored and outcomes and all(outcome.failure is not None for outcome in outcomes):
            raise RewardConfigError(
                f"reward function {self.spec.describe()} failed on every one of the {len(outcomes)} samples of this "
                f"step, so the run would train on the constant failure_score={self.failure_score}; the first "
                f"failure: {outcomes[0].failure.summary}. Fix the function (the traceback is logged above) or "
                "its reward_model / custom_reward_function settings")
        return self._assemble(outcomes)

    def close(self) -> None:
        """Stop the worker processes. Safe to call twice."""
        if self._pool is not None and not self._closed:
            self._pool.close()
        self._closed = True

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _log_once(self, outcome: ItemOutcome) -> None:
        failure = outcome.failure
        if failure.key in self._logged_failures:
            return
        self._logged_failures.add(failure.key)
        counter = "num_timeouts" if failure.kind == "timeout" else "num_errors"
        logger.warning(
            "reward function %s failed; the sample scores %s. Later failures like this one are "
            "only counted (%s).\n%s%s",
            self.spec.describe(),
            self.failure_score,
            counter,
            failure.summary,
            f"\n{failure.details}" if failure.details else "",
        )

    def _assemble(self, outcomes: list[ItemOutcome]) -> RewardResult:
        metric_names = list(dict.fromkeys(name for o in outcomes for name in o.metrics))
        return RewardResult(
            scores=[self.failure_score if o.failure else o.score for o in outcomes],
            extras={
                name: [o.metrics.get(name, math.nan) for o in outcomes] for name in metric_names
            },
            num_errors=sum(o.failure is not None and o.failure.kind == "error" for o in outcomes),
            num_timeouts=sum(o.failure is not None and o.failure.kind == "timeout" for o in outcomes),
        )
