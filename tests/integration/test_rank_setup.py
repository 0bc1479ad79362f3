"""Each role's engine is built on the backend its configuration names (`rank_setup.build_rank_roles`)."""

from __future__ import annotations

import pytest

from ember.config import load_config
from ember.trainer import rank_setup
from rl_helpers import prepare_inputs, run_overrides


class RecordedEngine:
    """Stands in for an engine: remembers what `build_engine` was asked for."""

    dp_size = 1  # one rank: the roles' mini-batch shares are whole

    def __init__(self, role, megatron):
        self.role, self.megatron = role, megatron

    def offload(self):
        pass


@pytest.mark.parametrize("strategy", ["fsdp2", "megatron"])
def test_the_critic_is_built_on_the_strategy_it_names(tmp_path, monkeypatch, strategy):
    """`critic.strategy=megatron` reached nothing once: the critic then trained on FSDP2 without a word."""
    built = []

    def record(model_path, role, model_cfg, fsdp_config, optim, seed, *, megatron=None, **switches):
        built.append(RecordedEngine(role, megatron))
        return built[-1]

    monkeypatch.setattr(rank_setup, "build_engine", record)
    inputs = prepare_inputs(tmp_path)
    cfg = load_config(run_overrides(inputs, tmp_path / "run", "algorithm.adv_estimator=gae",
                                    f"critic.strategy={strategy}"))
    roles = rank_setup.build_rank_roles(cfg, ("critic",), total_steps=1)
    assert [engine.role for engine in built] == ["critic"] and roles["critic"].engine is built[0]
    assert (built[0].megatron is not None) == (strategy == "megatron")


def test_external_lib_is_imported_before_models_load_and_a_missing_one_is_named(tmp_path, monkeypatch):
    import sys

    from ember.config import ConfigError

    (tmp_path / "ember_test_custom_model.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inputs = prepare_inputs(tmp_path / "inputs")
    cfg = load_config(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.model.external_lib=ember_test_custom_model"))
    rank_setup.import_external_libs(cfg)
    assert sys.modules["ember_test_custom_model"].LOADED
    cfg = load_config(run_overrides(inputs, tmp_path / "run", "actor_rollout_ref.model.external_lib=no_such_module_x"))
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.external_lib=no_such_module_x cannot be imported"):
        rank_setup.import_external_libs(cfg)


def test_trust_remote_code_reaches_model_loading(tmp_path, monkeypatch):
    """`model.trust_remote_code` let only the tokenizer run checkpoint code once; models loaded without it."""
    import transformers

    from ember.engines.fsdp.engine import FSDPEngine
    from fsdp_engine_worker import engine_options, make_model_dir

    seen = []
    original = transformers.AutoConfig.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(spy))
    FSDPEngine(engine_options(make_model_dir("qwen2", str(tmp_path)), trust_remote_code=True))
    assert seen and all(flag is True for flag in seen)
