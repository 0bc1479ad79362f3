"""The batch reward manager: worker processes, failures, timeouts, metrics, order."""

import logging
import math
import multiprocessing
import os
import signal
import textwrap
import time

import pytest

from ember.rewards import RewardConfigError, RewardItem, RewardManager, resolve_reward_fn

HANG_S = 60.0  # a "sleep" item's call: far past any timeout used here
SLOW_S = 0.2  # a "slow" item's call: well within the timeout, though several in one chunk are not

# A reward function whose response text says how to misbehave.
REWARD_SOURCE = f"HANG_S = {HANG_S}\nSLOW_S = {SLOW_S}\n" + """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "raise":
        raise ValueError("cannot score this sample")
    if solution_str == "sleep":
        time.sleep(HANG_S)
    if solution_str == "slow":
        time.sleep(SLOW_S)
    if solution_str == "crash":
        os._exit(3)
    if solution_str == "none":
        return None
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "1.0"
    if solution_str == "no-score":
        return {"acc": 1.0}
    if solution_str == "exit":
        raise SystemExit(0)
    if solution_str == "dict":
        return {"score": 0.25, "acc": 1.0, "pred": "text is ignored"}
    if solution_str == "dict-len":
        return {"score": 0.75, "length": float(len(ground_truth))}
    return float(solution_str == ground_truth) + bonus
"""


@pytest.fixture(scope="module")
def reward_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "misbehaving_reward.py"
    path.write_text(textwrap.dedent(REWARD_SOURCE))
    return resolve_reward_fn(custom_path=str(path), reward_kwargs={"bonus": 0.5})


def numbered_items(count: int) -> list[RewardItem]:
    """Items scoring 1.5 at even positions and 0.5 at odd ones (with bonus=0.5)."""
    return [RewardItem("test", str(i), str(i if i % 2 == 0 else -i)) for i in range(count)]


def expected_scores(count: int) -> list[float]:
    return [1.5 if i % 2 == 0 else 0.5 for i in range(count)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_errors_get_failure_score_are_counted_and_logged_once(reward_spec, num_workers, caplog):
    items = numbered_items(40)
    for position in (3, 17, 31):
        items[position] = RewardItem("test", "raise", "x")
    items[10] = RewardItem("test", "none", "x")
    expected = expected_scores(40)
    for position in (3, 17, 31, 10):
        expected[position] = -1.0
    with caplog.at_level(logging.WARNING, logger="ember.rewards"):
        with RewardManager(reward_spec, num_workers=num_workers, failure_score=-1.0) as manager:
            result = manager.score(items)
            second = manager.score(items)
    assert result.scores == expected
    assert result.num_errors == 4 and result.num_timeouts == 0
    assert second.scores == expected and second.num_errors == 4
    raised_logs = [r.getMessage() for r in caplog.records if "ValueError" in r.getMessage()]
    assert len(raised_logs) == 1  # 6 failures of this kind over two calls, one log
    assert "cannot score this sample" in raised_logs[0]
    assert "Traceback" in raised_logs[0] and "misbehaving_reward.py" in raised_logs[0]
    invalid_return_logs = [r for r in caplog.records if "NoneType" in r.getMessage()]
    assert len(invalid_return_logs) == 1


def test_hung_call_times_out_alone_and_the_run_goes_on(reward_spec):
    items = numbered_items(200)
    items[57] = RewardItem("test", "sleep", "x")
    expected = expected_scores(200)
    expected[57] = 0.0
    with RewardManager(reward_spec, num_workers=2, timeout_s=0.5) as manager:
        manager.score(numbered_items(4))  # start the workers before timing
        started = time.monotonic()
        result = manager.score(items)
        elapsed = time.monotonic() - started
        assert result.scores == expected
        assert result.num_timeouts == 1 and result.num_errors == 0  # the timeout fired, for that item alone
        # It fired at about timeout_s, not when the call ended: a generous bound for a loaded machine
        # (the batch, a worker restart) that is still a quarter of the hang.
        assert elapsed < HANG_S / 4
        after = manager.score(numbered_items(30))  # the replaced worker serves the next call
    assert after.scores == expected_scores(30)


def test_each_hung_item_of_a_chunk_is_charged_once_and_the_rest_are_scored(reward_spec):
    """One worker, 40 items: chunks of 10, the first holding three hung items. Each costs a timeout of its
    own (the worker is replaced three times); the chunk's other items are scored, none charged."""
    items = numbered_items(40)
    expected = expected_scores(40)
    for position in (2, 5, 7):
        items[position] = RewardItem("test", "sleep", "x")
        expected[position] = -1.0
    with RewardManager(reward_spec, num_workers=1, timeout_s=0.5, failure_score=-1.0) as manager:
        result = manager.score(items)
    assert result.num_timeouts == 3 and result.num_errors == 0
    assert result.scores == expected


def test_the_timeout_is_per_item_not_per_chunk(reward_spec):
    """One worker, 32 items: the first chunk of 8 holds eight slow items, 1.6 s together but 0.2 s each,
    within timeout_s=1: none times out."""
    items = numbered_items(32)
    expected = expected_scores(32)
    for position in range(8):
        items[position] = RewardItem("test", "slow", str(position))
        expected[position] = 0.5  # a wrong answer plus the bonus
    with RewardManager(reward_spec, num_workers=1, timeout_s=1.0) as manager:
        result = manager.score(items)
    assert 8 * SLOW_S > 1.0
    assert result.num_timeouts == 0 and result.num_errors == 0
    assert result.scores == expected


def test_crashed_worker_counts_as_error_and_is_replaced(reward_spec):
    items = numbered_items(20)
    items[5] = RewardItem("test", "crash", "x")
    expected = expected_scores(20)
    expected[5] = 0.0
    with RewardManager(reward_spec, num_workers=1) as manager:
        result = manager.score(items)
        assert manager.score(numbered_items(6)).scores == expected_scores(6)
    assert result.scores == expected
    assert result.num_errors == 1 and result.num_timeouts == 0


def test_a_worker_that_died_while_idle_is_replaced_and_costs_no_sample(reward_spec):
    with RewardManager(reward_spec, num_workers=2) as manager:
        deadline = time.monotonic() + 60
        while not all(worker.ready for worker in manager._pool._workers):  # up: a death now is not a failed start
            assert manager.score(numbered_items(4)).scores == expected_scores(4) and time.monotonic() < deadline
        workers = [child for child in multiprocessing.active_children() if child.name == "ember-reward-worker"]
        assert len(workers) == 2
        for worker in workers:  # between steps: the out-of-memory killer, an operator's kill -9
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(timeout=10)
        result = manager.score(numbered_items(20))
    assert result.scores == expected_scores(20) and result.num_errors == 0 and result.num_timeouts == 0


def wait_until_ignored(pid: int, number: int, timeout_s: float = 60.0) -> None:
    """Until process `pid` ignores signal `number` (its SigIgn mask in /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        if mask >> (number - 1) & 1:
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} never ignored signal {number}")


def test_a_signal_to_the_whole_process_group_leaves_the_workers_to_their_parent(reward_spec):
    with RewardManager(reward_spec, num_workers=2) as manager:
        assert manager.score(numbered_items(4)).scores == expected_scores(4)  # the workers are up
        workers = [child for child in multiprocessing.active_children() if child.name == "ember-reward-worker"]
        assert len(workers) == 2
        for worker in workers:  # a worker still starting up has not set its handlers yet (SIGINT's first)
            wait_until_ignored(worker.pid, signal.SIGINT)
            wait_until_ignored(worker.pid, signal.SIGTERM)
        for worker in workers:  # what `timeout`, scancel or Ctrl-C send to every process of the job
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        result = manager.score(numbered_items(20))  # the parent finishes its step
    assert result.scores == expected_scores(20) and result.num_errors == 0
    assert not any(worker.is_alive() for worker in workers)  # and stops them itself


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dict_returns_become_per_sample_extras(reward_spec, num_workers):
    items = [
        RewardItem("test", "dict", "x"),
        RewardItem("test", "1", "1"),
        RewardItem("test", "dict-len", "abc"),
        RewardItem("test", "raise", "x"),
    ]
    with RewardManager(reward_spec, num_workers=num_workers) as manager:
        result = manager.score(items)
    assert result.scores == [0.25, 1.5, 0.75, 0.0]
    assert set(result.extras) == {"acc", "length"}
    acc, length = result.extras["acc"], result.extras["length"]
    assert acc[0] == 1.0 and all(math.isnan(v) for v in acc[1:])
    assert length[2] == 3.0 and math.isnan(length[0]) and math.isnan(length[1]) and math.isnan(length[3])


def test_config_error_is_raised_not_scored_and_manager_stays_usable():
    with RewardManager(resolve_reward_fn(), num_workers=2) as manager:
        with pytest.raises(RewardConfigError, match="'my/dataset'"):
            manager.score([RewardItem("my/dataset", "#### 1", "1")] * 10)
        result = manager.score([RewardItem("openai/gsm8k", "#### 1", "1")] * 10)
    assert result.scores == [1.0] * 10


def test_closed_manager_refuses_to_score(reward_spec):
    manager = RewardManager(reward_spec, num_workers=1)
    manager.close()
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.score(numbered_items(2))


def test_invalid_settings_are_rejected(reward_spec):
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(reward_spec, num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(reward_spec, timeout_s=0)


BATCH_SOURCE = """
def compute_score(data_sources, solution_strs, ground_truths, extra_infos=None, scale=1.0):
    if "boom" in solution_strs:
        raise RuntimeError("the batch scorer failed")
    if "short" in solution_strs:
        return [1.0]
    return [{"score": scale * len(text), "acc": float(text == truth)} if text != "bad" else "not a number"
            for text, truth in zip(solution_strs, ground_truths)]
"""


def test_the_batch_manager_calls_once_with_lists_and_names_failures(tmp_path, caplog):
    path = tmp_path / "batch_reward.py"
    path.write_text(BATCH_SOURCE)
    spec = resolve_reward_fn(custom_path=str(path), reward_kwargs={"scale": 2.0}, batched=True)
    with RewardManager(spec, num_workers=2, batched=True, failure_score=-1.0) as manager:
        result = manager.score([RewardItem("d", "ab", "ab"), RewardItem("d", "abc", "x"), RewardItem("d", "bad", "x")])
        assert result.scores == [4.0, 6.0, -1.0] and result.extras["acc"][:2] == [1.0, 0.0]
        assert result.num_errors == 1
        failed = manager.score([RewardItem("d", "boom", "x"), RewardItem("d", "ok", "x")])
        assert failed.scores == [-1.0, -1.0] and failed.num_errors == 2
        assert "the batch scorer failed" in caplog.text
        short = manager.score([RewardItem("d", "short", "x"), RewardItem("d", "ok", "x")])
        assert short.num_errors == 2
    with pytest.raises(RewardConfigError, match=r"must accept the keyword arguments \['solution_str'"):
        resolve_reward_fn(custom_path=str(path))  # a batch function under the per-sample managers
    with pytest.raises(RewardConfigError, match=r"\['solution_strs', 'ground_truths'\] with reward_model.reward_manager=batch"):
        resolve_reward_fn(target_spec={"_target_": "ember.rewards.gsm8k.compute_score"}, batched=True)
    with pytest.raises(RewardConfigError, match="built-in scorers are not"):
        resolve_reward_fn(batched=True)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("response, first_failure", [
    ("raise", r"ValueError at .*misbehaving_reward.py:\d+ \(data_source='test'\): cannot score this sample"),
    ("none", "returned NoneType"), ("nan", r"non-finite score \(nan\)"), ("text", "returned str"),
    ("no-score", "a dict without 'score'"), ("exit", r"SystemExit at .*misbehaving_reward.py"),
])
def test_a_step_whose_every_sample_failed_stops_naming_the_function_and_the_first_failure(
        reward_spec, num_workers, response, first_failure):
    items = [RewardItem("test", response, "x")] * 6
    with RewardManager(reward_spec, num_workers=num_workers, failure_score=-1.0) as manager:
        with pytest.raises(RewardConfigError, match=rf"reward function .*misbehaving_reward.py:compute_score failed on "
                                                    rf"every one of the 6 samples of this step.*failure_score=-1.0; "
                                                    rf"the first failure: .*{first_failure}"):
            manager.score(items, stop_if_none_scored=True)
        assert manager.score(items).scores == [-1.0] * 6  # validation counts them and goes on
        mixed = manager.score(items + [RewardItem("test", "2", "2")], stop_if_none_scored=True)
        assert mixed.scores == [-1.0] * 6 + [1.5] and mixed.num_errors == 6  # one scored: the step goes on


def test_a_batch_reward_of_the_wrong_length_stops_a_step(tmp_path):
    path = tmp_path / "batch_reward.py"
    path.write_text(BATCH_SOURCE)
    spec = resolve_reward_fn(custom_path=str(path), batched=True)
    with RewardManager(spec, batched=True) as manager:
        with pytest.raises(RewardConfigError, match=r"batch_reward.py:compute_score failed on every one of the 2 samples "
                                                    r".* the first failure: ValueError .*returned list of length 1 for 2"):
            manager.score([RewardItem("d", "short", "x"), RewardItem("d", "ok", "x")], stop_if_none_scored=True)
