"""fsdp_config.param_offload / optimizer_offload in an RL run: every role that offloads is on the
device only inside its own phases (rollout weight sync or generation with the actor's module,
log-probs, reference, values, updates, checkpoints) and back in CPU memory between them.

On CPU `offload()` has nowhere to move to, so the test records the engines' residency instead:
each use of an offloading engine must come between its `onload()` and the next `offload()`."""

from __future__ import annotations

import pytest

from ember.engines.fsdp.engine import FSDPEngine
from rl_helpers import build_trainer, close, run_overrides

A = "actor_rollout_ref"
USES = ("forward", "train_mini_batch", "named_parameters_for_sync", "save", "load")


@pytest.fixture
def residency(monkeypatch):
    """Per engine (by id): whether it is on the device now; uses of an offloading engine while it is not
    are collected in `misuses`."""
    state: dict[int, bool] = {}
    misuses: list[str] = []
    onload, offload = FSDPEngine.onload, FSDPEngine.offload

    def tracked_onload(self):
        state[id(self)] = True
        onload(self)

    def tracked_offload(self):
        state[id(self)] = False
        offload(self)

    monkeypatch.setattr(FSDPEngine, "onload", tracked_onload)
    monkeypatch.setattr(FSDPEngine, "offload", tracked_offload)
    for name in USES:
        original = getattr(FSDPEngine, name)

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if self.options.param_offload and not state.get(id(self), True):
                misuses.append(f"{self.options.role}.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FSDPEngine, name, guarded)
    return state, misuses


@pytest.mark.parametrize("rollout", ["hf", "ember"])
def test_offloading_roles_are_on_the_device_only_in_their_phases(inputs, tmp_path, residency, rollout):
    state, misuses = residency
    offload = ["fsdp_config.param_offload=True", "fsdp_config.optimizer_offload=True"]
    trainer = build_trainer(run_overrides(
        inputs, tmp_path / "run", f"{A}.rollout.name={rollout}", f"{A}.actor.use_kl_loss=True",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=True", "trainer.test_freq=1",
        *[f"{A}.actor.{key}" for key in offload], *[f"{A}.ref.{key}" for key in offload]))
    try:
        engines = [trainer.parts.actor.in_process().engine, trainer.parts.reference.in_process().engine]
        assert len(engines) == 2 and all(engine.options.param_offload for engine in engines)
        assert not any(state[id(engine)] for engine in engines)  # idle from the start
        trainer.fit()
        assert misuses == []
        assert not any(state[id(engine)] for engine in engines)  # and idle again after every phase
    finally:
        close(trainer)


def test_the_rollout_engine_is_built_after_the_offloading_engines_left_the_device(inputs, tmp_path, residency,
                                                                                  monkeypatch):
    """The engine sizes its KV cache by the memory free when it is built: with the actor's and reference's
    weights still on the device then, a 7B actor with offload on one GPU found no room for a cache."""
    from ember.trainer import rank_setup

    state, _ = residency
    built, build_rollout = FSDPEngine.__init__, rank_setup.build_policy_rollout
    at_rollout_build: list[dict[int, bool]] = []

    def tracked_init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        state[id(self)] = True  # an engine is built on the device

    def tracked_build_rollout(*args, **kwargs):
        at_rollout_build.append(dict(state))
        return build_rollout(*args, **kwargs)

    monkeypatch.setattr(FSDPEngine, "__init__", tracked_init)
    monkeypatch.setattr(rank_setup, "build_policy_rollout", tracked_build_rollout)
    offload = ["fsdp_config.param_offload=True", "fsdp_config.optimizer_offload=True"]
    trainer = build_trainer(run_overrides(
        inputs, tmp_path / "run", f"{A}.rollout.name=ember", f"{A}.actor.use_kl_loss=True",
        "trainer.total_training_steps=1", *[f"{A}.actor.{key}" for key in offload],
        *[f"{A}.ref.{key}" for key in offload]))
    try:
        assert len(at_rollout_build) == 1 and len(at_rollout_build[0]) == 2  # actor and reference, built before it
        assert not any(at_rollout_build[0].values())
    finally:
        close(trainer)
