"""Which GPUs each role of an RL run uses: the resource pools, from either form users write.

verl's form names pools with a GPU count per node and maps roles onto them:

    resource_pool.pools={train: [4, 4], critic: [4, 4]}  resource_pool.mapping={critic: critic}

The NLA seed documents write one entry per role with its total GPU count:

    resource_pool: {actor_rollout: {num_gpus: 4}, critic: {num_gpus: 4}}

The NLA fork's run files name pools under `ray_kwargs`, with a GPU count per node; a name
containing "actor" or "rollout" is the pool of actor, rollout and reference, one containing
"critic" the critic's, and pools of 0 GPUs are dropped (the fork's base file declares two):

    ray_kwargs: {resource_pool: {actor_rollout: {num_gpus: 4}, critic: {num_gpus: 4}}}

The fork itself never reads these pools (its check for them never passes) and always shares
every GPU, so a file it runs is never refused here: named pools that do not describe a shared
or split run (a critic pool of 0 GPUs, sizes that do not fit) leave every GPU shared, and a
split ember does honour differs from the fork's placement; `named_pool_note` says which.

The one thing to know: a run is either *shared* (one pool, or every pool asks for all the
GPUs of the run: the roles live in the same processes and take turns, offloading what is
idle) or *split* (pools whose sizes add up to the run's GPUs, laid out on disjoint GPUs in
the order written: their roles run concurrently). Any other request is refused with a
message naming the pools, what they ask for and what the run has. With
`actor_rollout_ref.hybrid_engine=false` the rollout has a pool of its own besides these, on GPUs after
the trainer's (verl's top-level `rollout.nnodes`/`rollout.n_gpus_per_node`). Pure functions of the
configuration; the worker groups (`ember/distributed`) place processes by the `Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.config.errors import ConfigError
from ember.config.parallel import world_size
from ember.config.schema import EmberConfig
from ember.config.schema.resources import ROLES

ACTOR_ROLE = "actor_rollout"
ROLLOUT_POOL = "rollout"  # with actor_rollout_ref.hybrid_engine=false: the rollout's own GPUs (top-level `rollout`)
NAMED_POOL_ROLES = {"actor": ACTOR_ROLE, "rollout": ACTOR_ROLE, "critic": "critic"}  # name part -> role (the fork's rule)


@dataclass(frozen=True)
class Pool:
    """A set of GPUs: `gpus_per_node` on each of `nnodes` machines, from GPU `first_gpu` of each."""

    name: str
    gpus_per_node: int
    nnodes: int
    first_gpu: int = 0

    @property
    def size(self) -> int:
        """GPUs (one worker process each) in the pool."""
        return self.gpus_per_node * self.nnodes


@dataclass(frozen=True)
class Placement:
    """The run's pools and the pool of each role (actor_rollout, ref, critic, reward_model)."""

    pools: tuple[Pool, ...]
    role_pools: dict[str, str]

    @property
    def split(self) -> bool:
        """Pools on disjoint GPUs, running concurrently (otherwise every role shares all GPUs)."""
        return len({(pool.first_gpu, pool.gpus_per_node) for pool in self.pools}) > 1

    @property
    def total_gpus(self) -> int:
        """GPUs of the run: shared pools counted once."""
        return sum(pool.size for pool in {(pool.first_gpu, pool.gpus_per_node, pool.nnodes): pool
                                          for pool in self.pools}.values())

    def pool_of(self, role: str) -> Pool:
        name = self.role_pools.get(role, self.pools[0].name)
        return next(pool for pool in self.pools if pool.name == name)

    def colocated(self, role: str, other: str) -> bool:
        """Whether two roles live in the same worker processes."""
        return not self.split or self.pool_of(role) == self.pool_of(other)


def requested_pools(cfg: EmberConfig) -> tuple[dict[str, list[int] | int], dict[str, str], str]:
    """The pools as written, the role → pool mapping and which form was used ("pools", "role" or "named").

    verl's form and the named form give a list of per-node counts per pool; the role form a
    total count per role (its pool is named after the role). Giving two forms is an error.
    """
    config = cfg.resource_pool
    role_entries = {role: getattr(config, role) for role in ROLES if getattr(config, role) is not None}
    named = _named_pools(cfg.ray_kwargs.resource_pool, cfg.trainer.nnodes)
    given = (("resource_pool.pools + resource_pool.mapping (verl's form)", config.pools or config.mapping),
             ("resource_pool.<role>.num_gpus", role_entries), ("ray_kwargs.resource_pool (the NLA fork's form)", named))
    forms = [text for text, present in given if present]
    if len(forms) > 1:
        raise ConfigError(f"resource_pool: give the pools in one form, {' or '.join(forms)}, not both")
    if role_entries:
        return ({role: entry.num_gpus for role, entry in role_entries.items()},
                {role: role for role in role_entries}, "role")
    if named and _named_problem(named, cfg) is None:
        return named, _named_pool_roles(named), "named"
    if named or (cfg.ray_kwargs.resource_pool and not forms):  # the fork's pools, unusable: all GPUs shared, as there
        return {}, {}, "named"
    return dict(config.pools), dict(config.mapping), "pools"


def _named_problem(named: dict[str, list[int]], cfg: EmberConfig) -> str | None:
    """Why the fork's named pools describe no shared or split run (None: they do)."""
    if not named:
        return "no pool has GPUs"
    try:
        mapping = _named_pool_roles(named)
    except ConfigError as error:
        return str(error)
    return "; ".join(_size_errors(named, mapping, "named", cfg)) or None


def named_pool_note(cfg: EmberConfig) -> str | None:
    """One line for the log where the fork's named pools place the run otherwise than the fork, which never
    reads them and shares every GPU (None: no named pools, or they ask for sharing too)."""
    named = _named_pools(cfg.ray_kwargs.resource_pool, cfg.trainer.nnodes)
    if not named:  # none, or only the fork base's 0-GPU declarations: nothing asked of the placement
        return None
    problem = _named_problem(named, cfg)
    if problem is not None:
        return (f"ray_kwargs.resource_pool is not used ({problem}): the NLA fork never reads these pools and shares "
                "every GPU between its roles, and so does this run")
    placement = plan_placement(cfg)
    if placement.split:
        sizes = " + ".join(f"{pool.name} {pool.size}" for pool in placement.pools)
        return (f"ray_kwargs.resource_pool puts the roles on separate GPUs as written ({sizes}); the NLA fork never "
                "reads these pools and shares every GPU, so its run of this file is placed otherwise (same numbers)")
    return None


def _named_pools(entries: dict[str, object], nnodes: int) -> dict[str, list[int]]:
    """The fork's named pools with their per-node GPU counts as verl's lists, 0-GPU pools dropped."""
    pools = {}
    for name, entry in entries.items():
        key = f"ray_kwargs.resource_pool.{name}"
        if not isinstance(entry, dict) or not set(entry) <= {"num_gpus", "num_cpus"}:
            raise ConfigError(f"{key}={entry!r} must be a mapping of num_gpus (per node) and optionally num_cpus")
        gpus = entry.get("num_gpus", 0)
        if type(gpus) is not int or gpus < 0:
            raise ConfigError(f"{key}.num_gpus={gpus!r} must be a whole number of GPUs per node (0 drops the pool)")
        if gpus:
            pools[name] = [gpus] * nnodes
    return pools


def _named_pool_roles(pools: dict[str, list[int]]) -> dict[str, str]:
    """role -> pool by the fork's rule on pool names; both the actor's and the critic's pool must be named."""
    mapping = {}
    for name in pools:
        roles = {role for part, role in NAMED_POOL_ROLES.items() if part in name.lower()}
        if not roles:
            raise ConfigError(f"ray_kwargs.resource_pool.{name} names no role: a pool's name must contain actor or "
                              "rollout (the actor, rollout and reference) or critic (the critic)")
        mapping.update({role: name for role in roles})
    missing = [role for role in (ACTOR_ROLE, "critic") if role not in mapping]
    if missing:
        raise ConfigError(f"ray_kwargs.resource_pool names pools {', '.join(pools)} but none for {' or '.join(missing)}: "
                          "with named pools the fork needs one whose name contains actor (or rollout) and one whose "
                          "name contains critic (0-GPU pools do not count); give it GPUs, or remove the pools for "
                          "every role to share all GPUs")
    return mapping


def placement_errors(cfg: EmberConfig) -> list[str]:
    """Every problem with the requested pools (empty when they describe a shared or split run)."""
    try:
        requested, mapping, form = requested_pools(cfg)
    except ConfigError as error:
        return [str(error)]
    return _size_errors(requested, mapping, form, cfg)


def _size_errors(requested: dict[str, list[int] | int], mapping: dict[str, str], form: str,
                 cfg: EmberConfig) -> list[str]:
    """What is wrong with the pools' names and sizes against the run's GPUs."""
    nnodes, per_node = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    total = nnodes * per_node
    run = f"the run has {total} GPUs (trainer.nnodes × trainer.n_gpus_per_node = {nnodes} × {per_node})"
    errors = []
    for role, pool in mapping.items():
        if role not in ROLES:
            errors.append(f"resource_pool.mapping.{role} names no role; the roles are {', '.join(ROLES)}")
        if pool not in requested:
            errors.append(f"resource_pool.mapping.{role}={pool} names no pool in resource_pool.pools "
                          f"({', '.join(requested) or 'none defined'})")
    if not requested:
        return errors
    sizes = {}
    for name, counts in requested.items():
        key = {"pools": f"resource_pool.pools.{name}", "role": f"resource_pool.{name}.num_gpus",
               "named": f"ray_kwargs.resource_pool.{name}.num_gpus"}[form]
        if form != "role":
            if len(counts) != nnodes:
                errors.append(f"{key}={counts} must list a GPU count for each of the {nnodes} node(s)")
                continue
            if len(set(counts)) > 1:
                errors.append(f"{key}={counts} does not split evenly over the {nnodes} nodes; give every node the same count")
                continue
            size = sum(counts)
        else:
            size = counts
            if size >= 1 and size % nnodes:
                errors.append(f"{key}={size} does not split evenly over the {nnodes} nodes; use a multiple of {nnodes}")
                continue
        if size < 1:
            errors.append(f"{key}={counts} asks for no GPUs; every pool needs at least one (remove the pool to "
                          "put its roles with the others)")
        elif size > total:
            errors.append(f"{key}={counts} asks for {size} GPUs but {run}")
        sizes[name] = size
    if errors:
        return errors
    asked = " + ".join(f"{name} {size}" for name, size in sizes.items())
    shared = all(size == total for size in sizes.values())
    if not shared and sum(sizes.values()) != total:
        errors.append(f"resource_pool asks for {asked} = {sum(sizes.values())} GPUs but {run}: pools on separate GPUs "
                      f"must add up to {total}, or each ask for all {total} to share them")
    if form == "role" and ACTOR_ROLE not in sizes:
        errors.append(f"resource_pool names pools for {', '.join(sizes)} but not for {ACTOR_ROLE}: "
                      f"add resource_pool.{ACTOR_ROLE}.num_gpus")
    return errors


def plan_placement(cfg: EmberConfig) -> Placement:
    """The run's pools: one pool of every GPU without a request, else the requested ones (see the module docstring);
    with `actor_rollout_ref.hybrid_engine=false` a last pool "rollout" of the top-level `rollout` section's GPUs,
    after the trainer's (verl's one_step_off_policy layout), which only the rollout role uses."""
    errors = placement_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
    placement = _training_placement(cfg)
    if cfg.actor_rollout_ref.hybrid_engine:
        return placement
    rollout = Pool(ROLLOUT_POOL, cfg.rollout.n_gpus_per_node, cfg.rollout.nnodes, first_gpu=cfg.trainer.n_gpus_per_node)
    return Placement(pools=(*placement.pools, rollout), role_pools={**placement.role_pools, "rollout": ROLLOUT_POOL})


def _training_placement(cfg: EmberConfig) -> Placement:
    """The pools of the trainer's GPUs (trainer.nnodes × trainer.n_gpus_per_node)."""
    nnodes, per_node = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    requested, mapping, form = requested_pools(cfg)
    if not requested:
        return Placement(pools=(Pool("global", per_node, nnodes),), role_pools={})
    sizes = {name: sum(count) if isinstance(count, list) else count for name, count in requested.items()}
    # roles without a pool join the first: the actor's in the per-role and named forms, the first written in verl's
    names = list(sizes) if form == "pools" else sorted(sizes, key=lambda name: name != mapping[ACTOR_ROLE])
    shared = all(size == nnodes * per_node for size in sizes.values())
    pools, first_gpu = [], 0
    for name in names:
        pools.append(Pool(name, sizes[name] // nnodes, nnodes, first_gpu=0 if shared else first_gpu))
        first_gpu += 0 if shared else sizes[name] // nnodes
    return Placement(pools=tuple(pools), role_pools=mapping)


def role_gpus(cfg: EmberConfig, role: str) -> int:
    """GPUs of `role`'s pool, or of the whole run where the pools do not fit (their errors are reported apart)."""
    try:
        return plan_placement(cfg).pool_of(role).size
    except ConfigError:
        return world_size(cfg.trainer)

