"""Starting a local Ray: its background reporting switched off while it starts, unless a timeline needs it
or the user chose."""

import os
import sys
import types

import pytest
import torch

from ember.config import ConfigError, load_config
from ember.config.placement import plan_placement
from ember.distributed.ray_cluster import QUIET_RAY_ENVIRONMENT, start_ray


def fake_ray(seen: dict) -> types.ModuleType:
    """A `ray` whose init records the environment a started Ray would inherit."""
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    ray.init = lambda **kwargs: seen.update({name: os.environ.get(name) for name in QUIET_RAY_ENVIRONMENT})
    ray.cluster_resources = lambda: {"CPU": 8}
    ray.nodes = lambda: [{}]
    return ray


@pytest.mark.parametrize("timeline, user_value, expected", [
    (None, None, {"RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": "0"}),
    ("t.json", None, {"RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": None}),
    (None, "1000", {"RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": "1000"}),
])
def test_a_started_ray_reports_nothing_in_the_background_unless_asked(monkeypatch, timeline, user_value, expected):
    for name in QUIET_RAY_ENVIRONMENT:  # set, then removed: the test's end restores the variables as they were
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    if user_value is not None:
        monkeypatch.setenv("RAY_task_events_report_interval_ms", user_value)
    seen: dict = {}
    monkeypatch.setitem(sys.modules, "ray", fake_ray(seen))
    cfg = load_config(["trainer.n_gpus_per_node=2", "trainer.device=cpu"]
                      + ([f"ray_init.timeline_json_file={timeline}"] if timeline else []))
    start_ray(cfg.ray_init, plan_placement(cfg), wants_gpus=False)
    assert seen == expected
    # the driver's own environment is as before: a later Ray in this process (one with a timeline) chooses anew
    assert {name: os.environ.get(name) for name in QUIET_RAY_ENVIRONMENT} == {
        "RAY_enable_metrics_collection": None, "RAY_task_events_report_interval_ms": user_value}


def test_more_nodes_than_the_cluster_has_machines_is_refused(monkeypatch):
    ray = fake_ray({})
    ray.nodes = lambda: [{"Alive": True}, {"Alive": False}]  # one machine up, one gone
    monkeypatch.setitem(sys.modules, "ray", ray)
    cfg = load_config(["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=r"trainer.nnodes=2 but the Ray cluster has 1 machine\(s\)"):
        start_ray(cfg.ray_init, plan_placement(cfg), wants_gpus=False)
    ray.nodes = lambda: [{"Alive": True}, {"Alive": True}]
    start_ray(cfg.ray_init, plan_placement(cfg), wants_gpus=False)


@pytest.mark.parametrize(("asked", "visible_env", "seen", "expected"), [
    (None, None, 4, None),  # Ray counts the machine's GPUs itself
    (None, "0,1", 2, 2),  # some of a host's GPUs: Ray would refuse to count the host's
    (8, None, 4, 4),  # the NLA fork's 8 on a 4-GPU machine
    (2, None, 4, 2),
    (0, None, 0, 0),  # a CPU run
])
def test_ray_holds_at_most_the_gpus_this_process_sees(monkeypatch, caplog, asked, visible_env, seen, expected):
    from ember.distributed import ray_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: seen > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen)
    if visible_env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_env)
    assert ray_cluster.visible_gpus(asked) == expected
    assert ("Ray gets" in caplog.text) == (asked is not None and asked > seen > 0)
