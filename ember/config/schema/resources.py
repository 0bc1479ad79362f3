"""Placement of roles on GPUs (`resource_pool`) and Ray start-up (`ray_init`).

With no pools given, every role shares all GPUs of the run (colocated: they take turns and
offload what they do not need). Named pools split the GPUs, e.g. the actor, rollout and
reference on 4 GPUs per node and the critic on the other 4, running concurrently. Pools
come in verl's form (`pools` + `mapping`), the per-role form of the NLA seed documents
(`resource_pool: {actor_rollout: {num_gpus: 4}}`) or the NLA fork's named form
(`ray_kwargs.resource_pool: {NAME: {num_gpus: 4}}`); `ember/config/placement.py` reads all three.
"""

from dataclasses import dataclass
from typing import Any

from ember.config.schema.base import field_

ROLES: tuple[str, ...] = ("actor_rollout", "ref", "critic", "reward_model")


@dataclass
class RolePoolConfig:
    """A role's own pool in the per-role form."""

    num_gpus: int = field_(1, "GPUs of the pool, over all nodes (the same number on each node)")
    num_cpus: int | None = field_(None, "verl: CPUs Ray reserves for the pool; ember reserves one per GPU (no effect)")


@dataclass
class ResourcePoolConfig:
    """Named GPU pools and which role runs in which pool."""

    pools: dict[str, list[int]] = field_(
        {}, "GPUs each pool takes on each node, e.g. {train: [4, 4], critic: [4, 4]}; empty = one pool of all GPUs")
    mapping: dict[str, str] = field_(
        {}, "role -> pool name for roles actor_rollout, ref, critic, reward_model; a role not listed uses the first pool")
    actor_rollout: RolePoolConfig | None = field_(None, "per-role form: the pool of actor, rollout and reference")
    ref: RolePoolConfig | None = field_(None, "per-role form: the reference's own pool; null = with actor_rollout")
    critic: RolePoolConfig | None = field_(None, "per-role form: the critic's pool; null = with actor_rollout")
    reward_model: RolePoolConfig | None = field_(None, "per-role form: the reward model's pool; null = with actor_rollout")


@dataclass
class RayInitConfig:
    """Arguments of ray.init for multi-GPU runs."""

    num_cpus: int | None = field_(None, "CPUs Ray may use; null = all of the machine")
    num_gpus: int | None = field_(None, "GPUs Ray may use on this machine; null = all of them")
    timeline_json_file: str | None = field_(None, "write a Ray timeline (chrome://tracing) to this file; null = none")


@dataclass
class RayKwargsConfig:
    """verl's `ray_kwargs` block; `ray_kwargs.ray_init.*` and `ray_kwargs.timeline_json_file` are read as `ray_init.*`."""

    resource_pool: dict[str, Any] = field_(
        {}, "named pools {NAME: {num_gpus, num_cpus}}, num_gpus per node: a NAME containing actor or rollout is "
        "the pool of actor, rollout and reference, one containing critic the critic's; pools of 0 GPUs are dropped; "
        "num_cpus: ember reserves one CPU per GPU (no effect)")


@dataclass
class RolloutPoolConfig:
    """verl's top-level `rollout` section (its one_step_off_policy recipe): the GPUs of a rollout pool apart
    from the trainer's, read only with `actor_rollout_ref.hybrid_engine=false`; `trainer.nnodes` ×
    `trainer.n_gpus_per_node` are then the training GPUs alone."""

    nnodes: int = field_(1, "machines of the rollout pool (hybrid_engine=false only)")
    n_gpus_per_node: int = field_(8, "GPUs of the rollout pool on each of its machines (hybrid_engine=false only)")
