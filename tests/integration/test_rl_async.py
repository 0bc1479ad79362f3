"""The rollout on a pool of its own (`actor_rollout_ref.hybrid_engine=false`), one-step-off-policy training
(`async_training.mode=one_step_off`) and fully asynchronous training with a staleness bound
(`async_training.mode=fully_async`), through Ray on CPU workers: the weights go from the actor's process to the
rollout's over a gloo group of their own, as NCCL carries them on GPUs."""

from __future__ import annotations

import json

import pytest
import ray

from ember.distributed.worker_group import WorkerError
from rl_helpers import NOT_REPRODUCIBLE, build_trainer, close, hf_weights, metrics_by_step, run_overrides, train

pytestmark = pytest.mark.slow
SPLIT = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1"]
# one-step-off runs correct the lag in verl's bypass mode: REINFORCE × π_θ/π_rollout per token, no old log-probs
ONE_STEP_OFF = [*SPLIT, "async_training.mode=one_step_off", "trainer.total_training_steps=4", "trainer.save_freq=2",
                "trainer.test_freq=4", "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.loss_type=reinforce", "algorithm.rollout_correction.rollout_is=token"]
FULLY_ASYNC = [*SPLIT, "async_training.mode=fully_async", "async_training.staleness_threshold=1",
               "async_training.trigger_parameter_sync_step=2", "trainer.total_training_steps=4", "trainer.save_freq=2",
               "trainer.test_freq=4"]
NOT_COMPARED = (*NOT_REPRODUCIBLE, "perf/weight_sync_gb", "perf/")


def overrides(inputs, run_dir, *extra):
    """The helpers' tiny GRPO run on ember's engine, its samples dumped per step."""
    return run_overrides(inputs, run_dir, "actor_rollout_ref.rollout.name=ember", "trainer.val_before_train=False",
                         f"trainer.rollout_data_dir={run_dir / 'dumps'}", *extra)


def dumped(run_dir, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "dumps" / f"{step}.jsonl").read_text().splitlines()]


def test_a_rollout_pool_of_its_own_runs_the_same_as_the_rollout_beside_the_actor(inputs, tmp_path, local_ray):
    hybrid_dir, split_dir = tmp_path / "hybrid", tmp_path / "split"
    train(overrides(inputs, hybrid_dir))
    trainer = build_trainer(overrides(inputs, split_dir, *SPLIT))
    try:
        assert trainer.parts.rollout.group is not trainer.parts.actor.group
        trainer.fit()
        rollout_host = trainer.parts.rollout.group._hosts[0]
        ray.kill(rollout_host)  # a dead rollout worker is named by pool and rank
        with pytest.raises(WorkerError, match="rollout rank 0: its worker process died"):
            trainer.parts.rollout.generate([[1, 2, 3]], trainer.sampling())
    finally:
        close(trainer)
    hybrid, split = metrics_by_step(hybrid_dir), metrics_by_step(split_dir)
    for step in (1, 2, 3):
        assert split[step]["timing_s/weight_sync"] > 0 and split[step]["perf/weight_sync_gb"] > 0
        compared = {key for key in hybrid[step] if not key.startswith(NOT_COMPARED)}
        assert compared and {key: split[step][key] for key in compared} == {key: hybrid[step][key] for key in compared}
        for run_dir in (hybrid_dir, split_dir):  # the weights of the step before generated each step's samples
            assert {record["policy_version"] for record in dumped(run_dir, step)} == {step - 1}
    assert hf_weights(split_dir / "hf_model").keys() == hf_weights(hybrid_dir / "hf_model").keys()
    for name, weight in hf_weights(hybrid_dir / "hf_model").items():
        assert hf_weights(split_dir / "hf_model")[name].equal(weight), name


@pytest.fixture(scope="module")
def one_step_off_run(inputs, tmp_path_factory, local_ray):
    """4 one-step-off steps (bypass mode) with a checkpoint at step 2, while step 3's generation is in flight."""
    run_dir = tmp_path_factory.mktemp("one-step-off")
    train(overrides(inputs, run_dir, *ONE_STEP_OFF))
    return run_dir


def test_one_step_off_generates_each_step_with_the_weights_one_update_behind(one_step_off_run):
    metrics = metrics_by_step(one_step_off_run)
    # step k trains from the weights of step k-1; its samples came from those of step k-2 (the start's for k <= 2)
    assert [{record["policy_version"] for record in dumped(one_step_off_run, step)} for step in (1, 2, 3, 4)] == [
        {0}, {0}, {1}, {2}]
    assert [metrics[step]["rollout/staleness/max"] for step in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert all("timing_s/wait_prev_gen" in metrics[step] for step in (2, 3, 4))
    assert all(metrics[step]["actor/grad_norm"] > 0 for step in (1, 2, 3, 4))


def test_one_step_off_in_bypass_mode_weights_the_lagged_samples_by_the_trained_over_the_rollout_policy(
        one_step_off_run):
    metrics = metrics_by_step(one_step_off_run)
    assert not any("timing_s/old_log_prob" in metrics[step] for step in (1, 2, 3, 4))  # the rollout's are π_old
    gap = {step: max(metrics[step]["rollout_corr/rollout_is_max"] - 1, 1 - metrics[step]["rollout_corr/rollout_is_min"])
           for step in (1, 2, 3, 4)}
    assert gap[1] < 1e-4  # step 1 trains the weights that generated it: engine and trainer agree
    assert all(gap[step] > 1e-3 for step in (2, 3, 4))  # one update behind: the weights differ from 1


@pytest.fixture(scope="module")
def fully_async_run(inputs, tmp_path_factory, local_ray):
    """4 fully-async steps, generation one step ahead, weights synced every 2 updates, a checkpoint at step 2."""
    run_dir = tmp_path_factory.mktemp("fully-async")
    train(overrides(inputs, run_dir, *FULLY_ASYNC))
    return run_dir


def test_fully_async_keeps_every_sample_within_the_bound_its_schedule_allows_and_drops_none(fully_async_run):
    metrics = metrics_by_step(fully_async_run)
    versions = {step: [record["policy_version"] for record in dumped(fully_async_run, step)] for step in (1, 2, 3, 4)}
    # step k trains the weights of step k-1's update; generation one step ahead with weights synced every 2 updates
    # puts no sample more than 1 + 2 - 1 = 2 updates behind them
    assert all(step - 1 - version <= 2 for step in (1, 2, 3, 4) for version in versions[step])
    # step 3's batch was generated during step 2 with the start's weights (1 update since the last sync: none due),
    # 2 behind and kept; step 4's during step 3, after a sync with step 2's weights
    assert [set(versions[step]) for step in (1, 2, 3, 4)] == [{0}, {0}, {0}, {2}]
    assert [metrics[step]["rollout/stale_dropped"] for step in (1, 2, 3, 4)] == [0.0, 0.0, 0.0, 0.0]
    assert [metrics[step]["rollout/staleness/max"] for step in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 1.0]


def test_fully_async_resume_regenerates_the_batches_in_flight_at_the_checkpoint(inputs, fully_async_run, tmp_path):
    resumed_dir = tmp_path / "resumed"
    train(overrides(inputs, resumed_dir, *FULLY_ASYNC, "trainer.resume_mode=resume_path",
                    f"trainer.resume_from_path={fully_async_run / 'global_step_2'}"))
    assert sorted(path.name for path in (resumed_dir / "dumps").iterdir()) == ["3.jsonl", "4.jsonl"]
    prompts = {step: [record["input"] for record in dumped(fully_async_run, step)] for step in (1, 2, 3, 4)}
    resumed = {step: [record["input"] for record in dumped(resumed_dir, step)] for step in (3, 4)}
    assert resumed == {3: prompts[3], 4: prompts[4]}  # step 3's prompts again, none skipped, none repeated
    assert len({prompt for step in (1, 2, 3, 4) for prompt in prompts[step]}) == 4 * 4  # 4 prompts a step, all new
    # the batch in flight at the checkpoint is generated again with the checkpoint's weights (step 2's)
    assert [{record["policy_version"] for record in dumped(resumed_dir, step)} for step in (3, 4)] == [{2}, {2}]
    assert [metrics_by_step(resumed_dir)[step]["rollout/stale_dropped"] for step in (3, 4)] == [0.0, 0.0]
