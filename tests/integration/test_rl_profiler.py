"""Where a run's time goes: `global_profiler`'s profiles of chosen steps, with a phase table per process,
and the start-up breakdown logged with the first step."""

from __future__ import annotations

import json

import pytest

from rl_helpers import metrics_by_step, run_overrides, train

PROFILE = ["global_profiler.tool=torch", "trainer.val_before_train=False"]


def phase_names(table: str) -> list[str]:
    """The phase column of a phase table, indentation kept."""
    return [line[:44].rstrip() for line in table.splitlines()[2:] if line.strip() and not line.startswith("(")]


def test_the_named_steps_of_a_run_in_one_process_are_profiled_with_nested_phases(inputs, tmp_path):
    save_path = tmp_path / "profile"
    train(run_overrides(inputs, tmp_path / "run", *PROFILE, "global_profiler.steps=[2,3]",
                        f"global_profiler.save_path={save_path}", "actor_rollout_ref.rollout.name=ember"))
    assert sorted(path.name for path in save_path.iterdir()) == ["step_2", "step_3"]
    name = "actor_rank0"  # the roles of the one process, which also runs the driver
    assert sorted(path.name for path in (save_path / "step_2").iterdir()) == [
        f"{name}.operators.txt", f"{name}.phases.txt", f"{name}.trace.json"]
    phases = phase_names((save_path / "step_2" / f"{name}.phases.txt").read_text())
    assert phases[0] == "step"
    for nested in ("  gen", "    rollout.generate", "      rollout/weight_sync", "      engine/prefill",
                   "      engine/decode", "  update_actor", "    actor.update", "      train/forward",
                   "      train/backward", "      train/optimizer_step"):
        assert nested in phases, (nested, phases)
    trace = json.loads((save_path / "step_2" / f"{name}.trace.json").read_text())
    assert any(event.get("name") == "ember/step" for event in trace["traceEvents"])
    first, second = metrics_by_step(tmp_path / "run")[1], metrics_by_step(tmp_path / "run")[2]
    phases = {key.removeprefix("timing_s/startup/") for key in first if key.startswith("timing_s/startup/")}
    assert {"rewards", "data", "roles", "resume", "total"} <= phases and "validation" not in phases  # none before
    assert first["timing_s/startup/roles"] > 0 and not any(key.startswith("timing_s/startup/") for key in second)


@pytest.mark.slow
def test_profiles_of_a_run_on_ray_workers_come_from_every_process(inputs, tmp_path, local_ray):
    save_path = tmp_path / "profile"
    train(run_overrides(inputs, tmp_path / "run", *PROFILE, "trainer.n_gpus_per_node=2",
                        "algorithm.adv_estimator=gae", "trainer.total_training_steps=2",
                        "+resource_pool.actor_rollout.num_gpus=1", "+resource_pool.critic.num_gpus=1",
                        "global_profiler.steps=[1,2]", "global_profiler.profile_continuous_steps=True",
                        f"global_profiler.save_path={save_path}"))
    folder = save_path / "steps_1-2"
    assert sorted(path.name for path in folder.glob("*.phases.txt")) == [
        "actor_rank0.phases.txt", "critic_rank0.phases.txt", "driver.phases.txt"]
    driver = phase_names((folder / "driver.phases.txt").read_text())
    assert driver[:1] == ["step"] and "  update_critic" in driver
    critic = phase_names((folder / "critic_rank0.phases.txt").read_text())
    assert "critic.update" in critic and "  train/backward" in critic
    assert (folder / "critic_rank0.phases.txt").read_text().splitlines()[2].split()[1] == "2"  # both steps' updates
