"""Starting or joining Ray for a run on many GPUs, and checking the cluster can hold its pools.

`ray.init()` joins the cluster named by RAY_ADDRESS (or one started with `ray start` on this
machine) and otherwise starts a local Ray with this machine's CPUs and GPUs. Workers inherit
the driver's PYTHONPATH, so ember runs from a checkout as it does from an install.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ember.config.errors import ConfigError
from ember.config.placement import Placement
from ember.config.schema.resources import RayInitConfig
from ember.distributed.worker_group import RayOptions


logger = logging.getLogger(__name__)


def start_ray(ray_init: RayInitConfig, placement: Placement, wants_gpus: bool) -> RayOptions:
    """Ray running (started here if needed) and holding the pools' GPUs; how the pools' workers are placed.

    Workers take a GPU each when the cluster has GPUs and the run did not ask for the CPU
    (`trainer.device=cpu`); otherwise each is a CPU worker (tests, CPU clusters).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("a run on several GPUs (trainer.nnodes × trainer.n_gpus_per_node > 1) needs Ray: "
                          "pip install 'ember[ray]'") from None
    if not ray.is_initialized():
        environment = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
        with quiet_ray_environment(keep_task_events=ray_init.timeline_json_file is not None):
            ray.init(num_cpus=ray_init.num_cpus, num_gpus=visible_gpus(ray_init.num_gpus), include_dashboard=False,
                     runtime_env={"env_vars": environment})
    resources = ray.cluster_resources()
    use_gpus = wants_gpus and resources.get("GPU", 0) > 0
    kind = "GPU" if use_gpus else "CPU"
    needed = placement.total_gpus
    if resources.get(kind, 0) < needed:
        nodes = max(pool.nnodes for pool in placement.pools)
        raise ConfigError(f"the run asks for {needed} {kind}s in Ray but the cluster has {int(resources.get(kind, 0))} "
                          f"(nodes: {len(ray.nodes())}, wanted {nodes}). On several machines start Ray first: "
                          "`ray start --head` on one, `ray start --address=HEAD_IP:6379` on the others, then run "
                          "ember on the head; or lower trainer.nnodes / trainer.n_gpus_per_node")
    nodes, alive = max(pool.nnodes for pool in placement.pools), sum(node.get("Alive", True) for node in ray.nodes())
    if alive < nodes:  # its ranks would all run on the machines there are, and the run would end as if it had not
        raise ConfigError(f"trainer.nnodes={nodes} but the Ray cluster has {alive} machine(s). On several machines "
                          "start Ray first: `ray start --head` on one, `ray start --address=HEAD_IP:6379` on the "
                          "others, then run ember on the head; on one machine set trainer.nnodes=1")
    return RayOptions(use_gpus=use_gpus)


def visible_gpus(asked: int | None) -> int | None:
    """The GPUs a Ray started here holds: `ray_init.num_gpus`, at most the GPUs this process sees, else (null)
    those it sees. Ray counts a host's GPUs itself and refuses to start when CUDA_VISIBLE_DEVICES names fewer
    ("Attempting to start raylet with 8 GPU, but CUDA_VISIBLE_DEVICES contains ..."), and without that variable
    takes a larger num_gpus at its word (the NLA fork's files ask for 8 whatever the machine has)."""
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked is None:
        return seen if os.environ.get("CUDA_VISIBLE_DEVICES") else None
    if seen and asked > seen:
        logger.warning("ray_init.num_gpus=%d but this machine has %d GPU(s) visible: Ray gets %d", asked, seen, seen)
        return seen
    return asked


QUIET_RAY_ENVIRONMENT = {"RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": "0"}
"""Ray's metrics export and task-event reporting, off: their background threads take the GIL from a
worker's launch-bound update (Ray's cost at one GPU: 6.5% of the GRPO step with them, 1.0% without,
BENCHMARKS.md). Task events feed `ray.timeline`, so a run that asks for a timeline keeps them."""


@contextlib.contextmanager
def quiet_ray_environment(keep_task_events: bool):
    """While a local Ray starts (its processes inherit the environment then): QUIET_RAY_ENVIRONMENT
    where the user set none of those variables; this process's environment is as before afterwards."""
    added = [name for name in QUIET_RAY_ENVIRONMENT if name not in os.environ
             and not (keep_task_events and name == "RAY_task_events_report_interval_ms")]
    os.environ.update({name: QUIET_RAY_ENVIRONMENT[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def write_timeline(path: str) -> None:
    """Ray's timeline of this run's tasks and actor calls as a chrome://tracing JSON file at `path`."""
    import ray

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ray.timeline(filename=path)
    logger.info("Ray timeline written to %s (open it in chrome://tracing or https://ui.perfetto.dev)", path)
