"""build_rollout: the engine names users write in actor_rollout_ref.rollout.name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ember.models.tiny import tiny_model_config
from ember.rollout import HFRollout, build_rollout


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_config(tiny_model_config("llama", vocab_size=32))


def test_hf_builds_a_hybrid_engine_on_the_given_module(model):
    engine = build_rollout("hf", model, pad_token_id=0, max_batch_size=7)
    assert isinstance(engine, HFRollout)
    assert engine.model is model and engine.max_batch_size == 7 and not engine.owns_model


def test_ember_needs_its_model_path_and_engine_config(model):
    with pytest.raises(ValueError, match="rollout.name=ember needs the model path and an EngineConfig"):
        build_rollout("ember", model, pad_token_id=0)


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_external_engines_are_refused_with_the_alternative(model, name):
    with pytest.raises(ValueError, match=f"{name} is not available in ember; use actor_rollout_ref.rollout.name=ember"):
        build_rollout(name, model, pad_token_id=0)


def test_unknown_name_lists_the_choices(model):
    with pytest.raises(ValueError, match="choose one of: hf, ember"):
        build_rollout("transformers", model, pad_token_id=0)


def test_hf_rejects_a_module_without_generate():
    with pytest.raises(TypeError, match="AutoModelForCausalLM"):
        build_rollout("hf", torch.nn.Linear(2, 2), pad_token_id=0)
