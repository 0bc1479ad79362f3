"""Worker groups on a local Ray with CPU workers: ranks of one process group, results in rank order,
split pools at the same time, and failures that name the rank."""

import pytest

from ember.config.placement import Pool
from ember.distributed.worker_group import LocalWorkerGroup, RayOptions, RayWorkerGroup, WorkerError

ray = pytest.importorskip("ray")
CPU_WORKERS = RayOptions(use_gpus=False)


def test_ray_workers_are_ranks_of_one_process_group(local_ray):
    from group_workers import SumWorker

    group = RayWorkerGroup(Pool("train", gpus_per_node=2, nnodes=1), SumWorker, 10, options=CPU_WORKERS)
    try:
        assert group.run_all("rank_and_world") == [(0, 2, "0"), (1, 2, "0")]
        assert group.run_each("all_reduce", [((1.0,), {}), ((2.0,), {})]) == [23.0, 23.0]
    finally:
        group.shutdown()


def test_split_pools_work_at_the_same_time(local_ray, tmp_path):
    from group_workers import SumWorker

    actor = RayWorkerGroup(Pool("actor", 1, 1), SumWorker, 0, options=CPU_WORKERS)
    critic = RayWorkerGroup(Pool("critic", 1, 1, first_gpu=1), SumWorker, 0, options=CPU_WORKERS)
    try:
        # each call returns only once the other pool's call has started: calls run one after the other never meet
        pending = [actor.start_all("meet", str(tmp_path), "actor", "critic", 30.0),
                   critic.start_all("meet", str(tmp_path), "critic", "actor", 30.0)]
        assert pending[0].wait() == ["critic"] and pending[1].wait() == ["actor"]
    finally:
        actor.shutdown()
        critic.shutdown()


def test_split_pools_build_at_the_same_time_and_a_failed_build_names_its_rank(local_ray, tmp_path):
    from group_workers import MeetingBuildWorker

    # Each pool's build waits to see the other's build start: the driver must not wait for the first pool's build
    # before it starts the second's.
    actor = RayWorkerGroup(Pool("actor", 1, 1), MeetingBuildWorker, str(tmp_path), "actor", "rollout", 30.0,
                           options=CPU_WORKERS)
    rollout = RayWorkerGroup(Pool("rollout", 1, 1, first_gpu=1), MeetingBuildWorker, str(tmp_path), "rollout",
                             "actor", 30.0, options=CPU_WORKERS)
    broken = RayWorkerGroup(Pool("critic", 2, 1, first_gpu=2), MeetingBuildWorker, str(tmp_path), "critic", None,
                            fail_rank=1, options=CPU_WORKERS)
    try:
        actor.wait_until_built()
        rollout.wait_until_built()
        assert actor.run_all("partner") == ["rollout"] and rollout.run_all("partner") == ["actor"]
        with pytest.raises(WorkerError) as error:
            broken.run_all("partner")  # the first call waits for the build, which failed
        assert "critic rank 1 failed in build" in str(error.value) and "planted build failure" in str(error.value)
    finally:
        for group in (actor, rollout, broken):
            group.shutdown()


def test_a_worker_that_raises_fails_the_call_with_its_rank_and_traceback(local_ray):
    from group_workers import SumWorker

    group = RayWorkerGroup(Pool("train", 2, 1), SumWorker, 0, options=CPU_WORKERS)
    try:
        with pytest.raises(WorkerError) as error:
            group.run_all("fail_on", 1)
        assert "train rank 1 failed in fail_on" in str(error.value)
        assert "planted failure on rank 1" in str(error.value) and "group_workers.py" in str(error.value)
    finally:
        group.shutdown()


def test_a_worker_process_that_dies_fails_the_call_naming_its_rank(local_ray):
    from group_workers import SumWorker

    group = RayWorkerGroup(Pool("train", 2, 1), SumWorker, 0, options=CPU_WORKERS)
    try:
        with pytest.raises(WorkerError) as error:
            group.run_all("die_on", 0)
        assert "train rank 0: its worker process died during die_on" in str(error.value)
    finally:
        group.shutdown()


def test_a_collective_a_rank_never_joins_fails_after_the_timeout(local_ray):
    from group_workers import SumWorker

    group = RayWorkerGroup(Pool("train", 2, 1), SumWorker, 0, 3.0, options=CPU_WORKERS)
    try:
        with pytest.raises(WorkerError) as error:
            group.run_all("all_reduce_without", 1)
        assert "train rank 0 failed in all_reduce_without" in str(error.value)
    finally:
        group.shutdown()


def test_the_local_group_is_the_same_surface_in_process():
    class Echo:
        def twice(self, value):
            return 2 * value

    group = LocalWorkerGroup(Echo)
    assert group.run_all("twice", 3) == [6] and group.run_each("twice", [((4,), {})]) == [8]
