"""A pool of reward-scoring processes that survives reward functions which hang or crash.

The design, and why:

- Workers are ``spawn`` processes, each with its own duplex pipe to the parent. Per-worker
  pipes (not shared queues) mean a worker killed mid-call cannot leave a shared lock held or
  a half-written message behind for the others.
- Items travel in chunks (a few per worker per batch, at most ``MAX_CHUNK_SIZE`` items), one
  message each way per chunk, so thousands of short items cost a few dozen messages.
- The timeout is per item, not per chunk: before each item a worker writes the item's
  position in its chunk and its start time (``time.monotonic``, a system-wide clock) into a
  small shared array. The parent checks these every ``POLL_INTERVAL_S``; when an item has run
  longer than ``timeout_s`` it kills that worker, charges that one item as a timeout, sends the
  chunk's other items to the queue again and starts a replacement worker. A slow item thus
  costs about ``timeout_s`` and no other item is charged; the items of the killed chunk that
  had finished are scored again (reward functions are pure, so only time is lost).
- A worker that dies while scoring (a segfault, ``os._exit``) is handled the same way, with
  the item counted as an error. One that dies while idle (killed, out of memory) is replaced
  when the next chunk finds its pipe closed, and the chunk waits for the new worker.

A worker's clock runs only while it scores an item, so its start-up (imports, ``spec.load()``)
is never charged to an item. Workers import the reward function themselves from the
picklable ``RewardFnSpec``. As with any ``spawn`` multiprocessing, a script that starts a pool
must guard its entry point with ``if __name__ == "__main__":``.
"""

import atexit
import math
import multiprocessing
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ember.rewards.contract import BoundRewardFn, RewardConfigError, RewardItem, split_reward_output
from ember.rewards.registry import RewardFnSpec

CHUNKS_PER_WORKER = 4  # chunks per worker and batch: enough to balance uneven item costs
MAX_CHUNK_SIZE = 256
POLL_INTERVAL_S = 0.05  # how late a timeout may be noticed
_IDLE = 0.0  # start time written while a worker is between items


@dataclass(frozen=True)
class Failure:
    """Why one sample got no score."""

    kind: str  # "error" or "timeout"
    key: tuple  # failures with equal keys are the same problem, logged once
    summary: str  # one line: what failed, where, on which data_source
    details: str = ""  # the traceback, when there is one


@dataclass(frozen=True)
class ItemOutcome:
    """The result of scoring one item: a score and metrics, or a failure."""

    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: Failure | None = None


def failure_location(error: BaseException) -> str:
    """`file:line` where a reward failed: the innermost frame outside installed packages (the user's
    code: a `sys.exit` wrapped by a library, e.g. wandb's exit hook, is named where it was called),
    else the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    own = [frame for frame in frames if "site-packages" not in frame.filename and "dist-packages" not in frame.filename]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def score_item(fn: BoundRewardFn, item: RewardItem) -> ItemOutcome:
    """Score one item; an exception from the function (``SystemExit`` included: a reward cannot end
    the run) becomes a failure, except a ``RewardConfigError``, which propagates because every item
    would fail the same way."""
    try:
        score, metrics = split_reward_output(fn(item))
    except RewardConfigError:
        raise
    except (Exception, SystemExit) as error:  # any bug in a user's reward function (sys.exit too) fails its sample
        where = failure_location(error)
        summary = f"{type(error).__name__} at {where} (data_source={item.data_source!r}): {error}"
        details = "".join(traceback.format_exception(error))
        return ItemOutcome(failure=Failure("error", (type(error).__name__, where), summary, details))
    return ItemOutcome(score, metrics)


def score_batch(fn, items: list) -> list[ItemOutcome]:
    """Score `items` with one call of a batch reward function; an exception (or an invalid return)
    fails every item with the same failure, a bad value fails its own item."""
    try:
        values = fn(items)
    except RewardConfigError:
        raise
    except (Exception, SystemExit) as error:
        where = failure_location(error)
        failure = Failure("error", (type(error).__name__, where),
                          f"{type(error).__name__} at {where} (a batch of {len(items)}): {error}",
                          "".join(traceback.format_exception(error)))
        return [ItemOutcome(failure=failure) for _ in items]
    outcomes = []
    for value in values:
        try:
            outcomes.append(ItemOutcome(*split_reward_output(value)))
        except (TypeError, ValueError) as error:
            outcomes.append(ItemOutcome(failure=Failure("error", (type(error).__name__, "batch value"), str(error))))
    return outcomes


def _worker_main(spec: RewardFnSpec, connection, progress) -> None:
    """Body of a worker process: load the function, then score chunks until told to stop."""
    # A signal to the whole process group (Ctrl-C, `timeout`, a SLURM time limit, `scancel`) is the parent's to
    # handle: it finishes the step (these workers score its rewards), saves, then stops them (`close`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fn = spec.load()
    connection.send(("ready",))
    while True:
        try:
            items = connection.recv()
        except EOFError:  # the parent is gone
            return
        if items is None:
            return
        try:
            outcomes = []
            for position, item in enumerate(items):
                with progress.get_lock():
                    progress[0], progress[1] = position, time.monotonic()
                outcomes.append(score_item(fn, item))
            message = ("done", outcomes)
        except RewardConfigError as error:
            message = ("fatal", str(error))
        with progress.get_lock():
            progress[1] = _IDLE
        connection.send(message)


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, context, spec: RewardFnSpec):
        self.connection, child_connection = context.Pipe()
        self.progress = context.Array("d", 2)  # [position in chunk, start time or _IDLE]
        self.process = context.Process(
            target=_worker_main,
            args=(spec, child_connection, self.progress),
            name="ember-reward-worker",
            daemon=True,
        )
        self.process.start()
        child_connection.close()
        self.ready = False  # has loaded the reward function
        self.chunk: list[int] | None = None  # indices of the items it is scoring

    def current_item(self) -> tuple[int, float]:
        """Position in the chunk of the item being scored, and when it started (or _IDLE)."""
        with self.progress.get_lock():
            return int(self.progress[0]), self.progress[1]

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class WorkerPool:
    """``num_workers`` reward processes; ``score(items)`` returns one outcome per item, in order."""

    def __init__(self, spec: RewardFnSpec, num_workers: int, timeout_s: float):
        self._context = multiprocessing.get_context("spawn")
        self._spec = spec
        self._timeout_s = timeout_s
        self._workers = [_Worker(self._context, spec) for _ in range(num_workers)]
        # Before multiprocessing's own exit handler, which would wait forever on workers that ignore its SIGTERM.
        atexit.register(self.close)

    def score(self, items: list[RewardItem]) -> list[ItemOutcome]:
        outcomes: list[ItemOutcome | None] = [None] * len(items)
        chunk_size = max(
            1, min(MAX_CHUNK_SIZE, math.ceil(len(items) / (len(self._workers) * CHUNKS_PER_WORKER)))
        )
        pending = deque(
            list(range(start, min(start + chunk_size, len(items))))
            for start in range(0, len(items), chunk_size)
        )
        try:
            while pending or self._busy_workers():
                self._dispatch(pending, items)
                self._receive(outcomes, pending, items)
                self._enforce_timeouts(outcomes, pending, items)
        except BaseException:
            for worker in self._busy_workers():  # their results would arrive in a later call
                self._replace(worker)
            raise
        return outcomes

    def close(self) -> None:
        """Stop the workers: ask politely, then kill those that do not exit within a second."""
        atexit.unregister(self.close)
        for worker in self._workers:
            try:
                worker.connection.send(None)
            except (BrokenPipeError, ConnectionResetError):  # already gone
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            worker.kill()
        self._workers = []

    def _busy_workers(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker.chunk is not None]

    def _dispatch(self, pending: deque, items: list[RewardItem]) -> None:
        for worker in list(self._workers):
            if pending and worker.ready and worker.chunk is None:
                chunk = pending.popleft()
                try:
                    worker.connection.send([items[index] for index in chunk])
                except (BrokenPipeError, ConnectionResetError):  # died while idle (killed, out of memory)
                    pending.appendleft(chunk)  # nothing was scored: the chunk waits for the replacement
                    self._replace(worker)
                    continue
                worker.chunk = chunk

    def _receive(self, outcomes: list, pending: deque, items: list[RewardItem]) -> None:
        watched = {w.connection: w for w in self._workers if not w.ready or w.chunk is not None}
        for connection in wait(list(watched), timeout=POLL_INTERVAL_S):
            worker = watched[connection]
            try:
                message = connection.recv()
            except EOFError:
                self._handle_exit(worker, outcomes, pending, items)
                continue
            if message[0] == "ready":
                worker.ready = True
            elif message[0] == "done":
                for index, outcome in zip(worker.chunk, message[1]):
                    outcomes[index] = outcome
                worker.chunk = None
            else:  # "fatal": the worker is idle again; the error ends this call
                worker.chunk = None
                raise RewardConfigError(message[1])

    def _handle_exit(self, worker: _Worker, outcomes: list, pending: deque, items) -> None:
        worker.process.join(timeout=1.0)
        exit_code = worker.process.exitcode
        if not worker.ready:
            raise RuntimeError(
                f"a reward worker exited with code {exit_code} while starting up (importing "
                f"{self._spec.describe()}); its traceback is printed above"
            )
        position, started = worker.current_item()
        if started == _IDLE:  # died between items: nothing to charge
            pending.appendleft(worker.chunk)
            worker.chunk = None
            self._replace(worker)
            return
        data_source = items[worker.chunk[position]].data_source
        summary = (
            f"the reward worker process exited with code {exit_code} while scoring a sample "
            f"(data_source={data_source!r}); a new worker was started"
        )
        failure = Failure("error", ("worker exit", exit_code), summary)
        self._charge_and_requeue(worker, position, failure, outcomes, pending)

    def _enforce_timeouts(self, outcomes: list, pending: deque, items) -> None:
        now = time.monotonic()
        for worker in self._busy_workers():
            position, started = worker.current_item()
            if started == _IDLE or now - started <= self._timeout_s or worker.connection.poll():
                continue
            data_source = items[worker.chunk[position]].data_source
            summary = (
                f"the reward function gave no result within timeout_s={self._timeout_s} "
                f"(data_source={data_source!r}); its worker was killed and replaced"
            )
            failure = Failure("timeout", ("timeout",), summary)
            self._charge_and_requeue(worker, position, failure, outcomes, pending)

    def _charge_and_requeue(self, worker, position, failure, outcomes, pending) -> None:
        """Give the item at ``position`` the failure, queue the chunk's others, replace the worker."""
        outcomes[worker.chunk[position]] = ItemOutcome(failure=failure)
        others = worker.chunk[:position] + worker.chunk[position + 1 :]
        if others:
            pending.appendleft(others)
        worker.chunk = None
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._context, self._spec)
