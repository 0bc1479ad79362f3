"""GRPO with `rollout.name=ember`: ember's own generation engine holds a copy of the weights,
is sent the actor's weights whenever the actor has changed, and generates like the hf rollout."""

from __future__ import annotations

import pytest
import torch

from ember.rollout import SamplingParams
from rl_helpers import all_finite, build_trainer, close, engine_weights, metrics_by_step, run_overrides


def test_grpo_with_the_ember_engine_syncs_trained_weights(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember",
                                          "trainer.val_before_train=True", "trainer.test_freq=3"))
    try:
        trainer.fit()
        rollout_weights = dict(trainer.parts.rollout.in_process().rollout.engine.model.named_parameters())
        actor_weights = engine_weights(trainer.parts.actor.in_process().engine)
        # The last validation (after the last update) synced the final weights into the engine.
        rollout, actor = trainer.parts.rollout.in_process(), trainer.parts.actor.in_process()
        assert rollout.synced_updates == actor.updates == 3 and rollout.policy_version == actor.version == 3
        for name, tensor in actor_weights.items():
            torch.testing.assert_close(rollout_weights[name].float(), tensor.float(), rtol=0, atol=0)
    finally:
        close(trainer)
    metrics = metrics_by_step(tmp_path / "run")
    assert all_finite(metrics[step]["actor/pg_loss"] for step in (1, 2, 3))
    assert 0.0 <= metrics[3][next(key for key in metrics[3] if key.endswith("/acc"))] <= 1.0


def test_a_vllm_script_runs_on_the_ember_engine_and_says_so(inputs, tmp_path, caplog):
    from ember.rollout.ember_rollout import EmberRollout

    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=vllm",
                                          "actor_rollout_ref.rollout.load_format=safetensors",
                                          "trainer.total_training_steps=1"))
    try:
        assert isinstance(trainer.parts.rollout.in_process().rollout, EmberRollout)
        trainer.fit()
    finally:
        close(trainer)
    assert "rollout.name=vllm: ember's own engine generates in its place" in caplog.text
    assert "not applied: load_format=safetensors" in caplog.text
    assert all_finite([metrics_by_step(tmp_path / "run")[1]["actor/pg_loss"]])


def test_the_ember_engine_generates_what_the_hf_rollout_generates(inputs, tmp_path):
    ember = build_trainer(run_overrides(inputs, tmp_path / "ember", "actor_rollout_ref.rollout.name=ember"))
    hf = build_trainer(run_overrides(inputs, tmp_path / "hf"))
    try:
        prompts = [ember.parts.train_loader.dataset[i].prompt_ids for i in range(4)]
        greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=8,
                                stop_token_ids=tuple(ember.parts.eos_token_ids))
        from_ember = [output.token_ids for output in ember.parts.rollout.generate(prompts, greedy)]
        from_hf = [output.token_ids for output in hf.parts.rollout.generate(prompts, greedy)]
        assert from_ember == from_hf
    finally:
        close(ember)
        close(hf)


def test_at_one_rank_the_engine_holds_the_actors_own_tensors(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember"))
    try:
        trainer.parts.rollout.in_process().prepare()
        engine_parameters = dict(trainer.parts.rollout.in_process().rollout.engine.model.named_parameters())
        live = {name: parameter.to_local() for name, parameter in trainer.parts.actor.in_process().engine.model.named_parameters()}
        assert set(live) == set(engine_parameters)
        assert all(engine_parameters[name].data_ptr() == tensor.data_ptr() for name, tensor in live.items())
        name = next(iter(live))
        with torch.no_grad():
            live[name].add_(1.0)  # an optimizer step changes the actor's tensors in place
        torch.testing.assert_close(engine_parameters[name], live[name], rtol=0, atol=0)
    finally:
        close(trainer)


def test_an_offloaded_actor_is_copied_not_shared(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember",
                                          "actor_rollout_ref.actor.fsdp_config.param_offload=True"))
    try:
        trainer.parts.rollout.in_process().prepare()
        engine_parameters = dict(trainer.parts.rollout.in_process().rollout.engine.model.named_parameters())
        live = {name: parameter.to_local() for name, parameter in trainer.parts.actor.in_process().engine.model.named_parameters()}
        assert not any(engine_parameters[name].data_ptr() == tensor.data_ptr() for name, tensor in live.items())
        for name, tensor in live.items():
            torch.testing.assert_close(engine_parameters[name], tensor, rtol=0, atol=0)
    finally:
        close(trainer)


@pytest.mark.parametrize("copy_mode", ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                                       "actor_rollout_ref.rollout.dtype=bfloat16"], ids=["param_offload", "bf16_engine"])
def test_an_engine_with_its_own_copy_is_sent_the_updated_weights(inputs, tmp_path, copy_mode):
    """Where the engine cannot share the actor's tensors (offloaded actor; generation dtype unlike the
    training one) every sync must copy: after an update the engine holds the updated weights, not the initial ones."""
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember",
                                          "trainer.total_training_steps=1", copy_mode))
    try:
        rollout, actor = trainer.parts.rollout.in_process(), trainer.parts.actor.in_process()
        rollout.prepare()
        engine = rollout.rollout.engine
        live = [parameter.to_local().data_ptr() for parameter in actor.engine.model.parameters()]
        assert not set(live) & {parameter.data_ptr() for parameter in engine.model.parameters()}  # copies
        initial = {name: tensor.clone() for name, tensor in engine.model.named_parameters()}
        trainer.fit()  # one update, then validation on the rollout engine
        assert actor.version == 1
        rollout.prepare()
        engine_parameters = dict(rollout.rollout.engine.model.named_parameters())
        with actor.engine.resident():
            actor_weights = engine_weights(actor.engine)
        assert set(actor_weights) == set(engine_parameters)
        for name, tensor in actor_weights.items():
            torch.testing.assert_close(engine_parameters[name], tensor.to(engine_parameters[name].dtype),
                                       rtol=0, atol=0, msg=name)
        changed = [name for name in initial if not torch.equal(engine_parameters[name], initial[name])]
        assert len(changed) > len(initial) // 2, changed
    finally:
        close(trainer)


def test_remax_and_validation_wake_the_engine_that_training_put_to_sleep(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember",
                                          "algorithm.adv_estimator=remax", "trainer.total_training_steps=2",
                                          "trainer.val_before_train=True", "trainer.test_freq=1"))
    try:
        trainer.fit()
        # free_cache_engine (the default): the cache is given back after every generation phase.
        assert trainer.parts.rollout.in_process().asleep and not trainer.parts.rollout.in_process().rollout.engine.kv_cache.is_allocated
    finally:
        close(trainer)
    metrics = metrics_by_step(tmp_path / "run")
    assert all_finite(metrics[step]["actor/pg_loss"] for step in (1, 2))


def test_noise_injection_noises_the_engines_copy_only_and_validation_is_clean(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.rollout.name=ember",
                                          "trainer.noise_injection.enabled=true", "trainer.noise_injection.num_stages=2",
                                          "trainer.noise_injection.sigma_start=0.05", "trainer.total_training_steps=2",
                                          "trainer.val_before_train=True", "trainer.test_freq=2"))
    try:
        rollout = trainer.parts.rollout.in_process()
        actor_before = engine_weights(trainer.parts.actor.in_process().engine)
        selected = set(rollout.noise.weights)
        prompts = [trainer.parts.train_loader.dataset[i].prompt_ids for i in range(2)]
        greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=4, stop_token_ids=tuple(trainer.parts.eos_token_ids))

        def engine_weights_now():
            return {name: tensor.detach().float().clone() for name, tensor in rollout.rollout.engine.model.named_parameters()}

        trainer.parts.rollout.use_noise(1)  # stage 1 of 2: σ = sigma_start
        trainer.parts.rollout.generate(prompts, greedy)
        noisy = engine_weights_now()
        for name, tensor in actor_before.items():
            if name in selected:
                assert (noisy[name] - tensor.float()).std().item() == pytest.approx(0.05, rel=0.5)
            elif name in noisy:
                assert torch.equal(noisy[name], tensor.float()), name
        after = engine_weights(trainer.parts.actor.in_process().engine)
        assert all(torch.equal(after[name], tensor) for name, tensor in actor_before.items())  # the actor untouched

        trainer.parts.rollout.use_noise(None)
        trainer.parts.rollout.generate(prompts, greedy)
        clean = engine_weights_now()
        assert all(torch.equal(clean[name], tensor.float()) for name, tensor in actor_before.items() if name in clean)
        trainer.fit()
    finally:
        close(trainer)
    metrics = metrics_by_step(tmp_path / "run")
    assert metrics[1]["noise/sigma"] == pytest.approx(0.05) and metrics[1]["noise/tensors"] == len(selected)
