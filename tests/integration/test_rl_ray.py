"""RL on two data-parallel ranks through Ray (CPU workers, gloo): the same update as one process,
split and shared pools, and checkpoints that resume on another number of ranks."""

from __future__ import annotations

import json

import pytest
import torch

from ember.trainer.checkpoint import list_checkpoints
from ember.trainer.export import export_checkpoint
from ember.trainer.experience import generate_experience, score_experience, token_level_scores
from rl_helpers import build_trainer, close, hf_weights, metrics_by_step, run_overrides, train

pytestmark = pytest.mark.slow
TWO_RANKS = ["trainer.n_gpus_per_node=2"]


def test_a_grpo_update_on_two_ranks_equals_the_one_process_update(inputs, tmp_path, local_ray):
    two_mini_batches = "actor_rollout_ref.actor.ppo_mini_batch_size=2"  # each divided over the data-parallel ranks
    one = build_trainer(run_overrides(inputs, tmp_path / "one", two_mini_batches))
    two = build_trainer(run_overrides(inputs, tmp_path / "two", two_mini_batches, *TWO_RANKS))
    try:
        assert two.parts.actor.dp_size == 2 and one.parts.actor.dp_size == 1
        prompts = next(iter(one.parts.train_loader))
        experience = generate_experience(one.parts.rollout, prompts, one.sampling(), one.parts.tokenizer,
                                         one.parts.eos_token_ids, uid_prefix="step1")
        batch = experience.batch
        batch.token_level_scores = token_level_scores(batch, score_experience(one.parts.reward_manager, experience).scores)
        one.compute_advantages(batch)
        assert batch.advantages.abs().sum() > 0
        torch.testing.assert_close(two.parts.actor.compute_log_probs(batch), one.parts.actor.compute_log_probs(batch),
                                   rtol=1e-5, atol=1e-5)
        # Each rank cuts its contiguous half into mini-batches of 4, as verl's workers do: optimizer step k
        # takes rank 0's k-th and rank 1's k-th 4 samples, which one process takes when given them in that order.
        as_two_ranks_take_them = [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)]
        metrics_one = one.parts.actor.update(batch.select(as_two_ranks_take_them), 1)
        metrics_two = two.parts.actor.update(batch, 1)
        assert metrics_two["actor/grad_norm"] == pytest.approx(metrics_one["actor/grad_norm"], rel=1e-4)
        one.parts.actor.export_hf(str(tmp_path / "one-hf"))
        two.parts.actor.export_hf(str(tmp_path / "two-hf"))
        before, after_one, after_two = (hf_weights(inputs.model_dir), hf_weights(tmp_path / "one-hf"),
                                        hf_weights(tmp_path / "two-hf"))
        for name, weight in after_one.items():
            # atol: a wrong split (a rank's half lost or counted twice) moves every weight by about the learning
            # rate, 1e-3 here; ranks' GEMMs over half the rows may round a gradient a last bit apart (seen on an
            # AVX-512 CPU: 1 of 8192 entries of three matrices, 1.9e-6 apart after Adam's step), which this allows
            torch.testing.assert_close(after_two[name], weight, rtol=1e-5, atol=1e-5, msg=name)
        assert any(not torch.equal(after_one[name], before[name]) for name in after_one)
    finally:
        close(one)
        close(two)


def test_ppo_with_the_critic_in_its_own_pool(inputs, tmp_path, local_ray):
    run_dir = tmp_path / "run"
    timeline = tmp_path / "timeline.json"
    trainer = train(run_overrides(inputs, run_dir, *TWO_RANKS, "algorithm.adv_estimator=gae",
                                  "trainer.total_training_steps=2", "trainer.val_before_train=False",
                                  "+resource_pool.actor_rollout.num_gpus=1", "+resource_pool.critic.num_gpus=1",
                                  f"ray_init.timeline_json_file={timeline}"))
    assert trainer.parts.critic.group is not trainer.parts.actor.group
    metrics = metrics_by_step(run_dir)
    for step in (1, 2):
        assert metrics[step]["critic/grad_norm"] > 0 and metrics[step]["actor/grad_norm"] > 0
        for role in ("actor", "critic"):  # each pool's slowest rank and largest peak memory
            assert metrics[step][f"perf/{role}/peak_memory_gb"] > 0
            assert metrics[step][f"perf/{role}/update_seconds_max_rank"] > 0
    assert (run_dir / "hf_model" / "model.safetensors").is_file()
    events = json.loads(timeline.read_text())  # Ray's chrome://tracing events of the workers' calls
    assert any("call" in str(event.get("name", "")) for event in events)


def test_ppo_with_shared_pools_runs_actor_and_critic_in_the_same_processes_in_turn(inputs, tmp_path, local_ray):
    run_dir = tmp_path / "run"
    trainer = train(run_overrides(inputs, run_dir, *TWO_RANKS, "algorithm.adv_estimator=gae",
                                  "trainer.total_training_steps=1", "trainer.val_before_train=False",
                                  "+resource_pool.actor_rollout.num_gpus=2", "+resource_pool.critic.num_gpus=2"))
    # Shared: one group of two processes holds both roles; each process runs one call at a time,
    # so the critic's update and the actor's take turns on the same ranks.
    assert trainer.parts.critic.group is trainer.parts.actor.group and trainer.parts.actor.dp_size == 2
    step = metrics_by_step(run_dir)[1]
    assert step["critic/grad_norm"] > 0 and step["actor/grad_norm"] > 0
    # In turn: the step took at least both updates' time on the slowest rank.
    assert step["timing_s/step"] >= step["perf/critic/update_seconds_max_rank"] + step["perf/actor/update_seconds_max_rank"]


def test_checkpoints_resume_on_another_number_of_ranks(inputs, tmp_path, local_ray):
    run_dir = tmp_path / "run"
    common = ["trainer.val_before_train=False", "trainer.save_freq=1"]
    train(run_overrides(inputs, run_dir, *TWO_RANKS, *common, "trainer.total_training_steps=2"))
    assert [step for step, _ in list_checkpoints(str(run_dir))][-1] == 2
    # the two ranks' shards, loaded by one process, are the weights the two ranks exported at the end
    one_process = hf_weights(export_checkpoint(str(run_dir / "global_step_2"), str(tmp_path / "step2")))
    two_ranks = hf_weights(run_dir / "hf_model")
    assert one_process.keys() == two_ranks.keys()
    assert all(torch.equal(one_process[name], two_ranks[name]) for name in two_ranks)
    on_one = train(run_overrides(inputs, run_dir, *common, "trainer.total_training_steps=3"))  # 2 ranks -> 1
    assert on_one.step == 3
    on_two = train(run_overrides(inputs, run_dir, *TWO_RANKS, *common, "trainer.total_training_steps=4"))  # 1 -> 2
    assert on_two.step == 4
    assert {3, 4} <= set(metrics_by_step(run_dir))


def test_a_worker_that_dies_fails_the_step_naming_it_and_the_run_resumes(inputs, tmp_path, local_ray):
    from ember.distributed.worker_group import WorkerError

    run_dir = tmp_path / "run"
    common = ["trainer.val_before_train=False", "trainer.save_freq=1", "trainer.total_training_steps=3", *TWO_RANKS]
    trainer = build_trainer(run_overrides(inputs, run_dir, *common))
    train_step = trainer.train_step

    def kill_rank_one_after_the_first_step(prompts):
        if trainer.step == 2:
            local_ray.kill(trainer.parts.actor.group._hosts[1])
        return train_step(prompts)

    trainer.train_step = kill_rank_one_after_the_first_step
    try:
        with pytest.raises(WorkerError, match=r"step 2: global rank 1: its worker process died") as error:
            trainer.fit()
        assert "trainer.resume_mode=auto" in str(error.value)
    finally:
        close(trainer)
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [1]
    resumed = train(run_overrides(inputs, run_dir, *common))
    assert resumed.step == 3 and {2, 3} <= set(metrics_by_step(run_dir))


def rank_worker_processes() -> set[int]:
    """Process ids of the Ray actors that host ranks (`worker_group._RankHost`)."""
    import subprocess

    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[0]) for line in listing.splitlines()[1:] if "ray::_RankHost" in line}


def test_ctrl_c_with_ray_workers_saves_and_leaves_no_worker_behind(inputs, tmp_path):
    import signal

    from rl_helpers import ember_train_process, logged_training_steps, wait_for

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    before = rank_worker_processes()
    overrides = run_overrides(inputs, run_dir, *TWO_RANKS, "trainer.total_training_steps=40",
                              "trainer.val_before_train=False", "+custom_reward_function.reward_kwargs.sleep_s=0.02")
    with ember_train_process(overrides, log_path, env={"RAY_ADDRESS": "local"}) as process:
        wait_for(lambda: len(logged_training_steps(run_dir)) >= 1, process, log_path, timeout_s=240)
        assert rank_worker_processes() - before  # the run's two ranks are worker processes
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0, log_path.read_text()[-4000:]
    stopped = logged_training_steps(run_dir)[-1]
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [stopped]
    assert f"stopping at step {stopped} on SIGINT" in log_path.read_text()
    import time

    deadline = time.monotonic() + 30
    while rank_worker_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not rank_worker_processes() - before
