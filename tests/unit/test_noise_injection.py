"""Adaptive noise injection (AQN): the fork's schedule at stage boundaries, the selection of weights
(defaults, the seed's list, JSON strings), the noise itself, and the error a selection of nothing gives."""

from __future__ import annotations

import pytest
import torch

from ember.config import load_config
from ember.errors import UserError
from ember.models.loading import build_model_on_meta
from ember.models.tiny import tiny_model_config
from ember.workers.noise_injection import build_noise_injection, pattern_list, select_weights, sigma_at


def test_the_schedule_is_zero_for_the_first_stage_then_geometric():
    # N = 10 over T = 100 steps: stage k = step // 10; σ = 0 in stage 0, then .01 · (0.1)^((k−1)/8)
    expected = [0.0] + [0.01 * 0.1 ** (index / 8) for index in range(9)]
    for stage, sigma in enumerate(expected):
        for step in (stage * 10, stage * 10 + 9):
            assert sigma_at(step, 100, 0.01, 0.001, 10) == pytest.approx(sigma)
    assert sigma_at(10, 100, 0.01, 0.001, 10) == pytest.approx(0.01)
    assert sigma_at(20, 100, 0.01, 0.001, 10) == pytest.approx(0.0074989, rel=1e-4)
    assert sigma_at(100, 100, 0.01, 0.001, 10) == pytest.approx(0.001)  # the last step stays at the end value
    assert [sigma_at(step, 10, 0.01, 0.001, 2) for step in (0, 4, 5, 9)] == [0.0, 0.0, 0.01, 0.01]  # N = 2
    assert sigma_at(50, 100, 0.01, 0.001, 1) == 0.0  # N <= 1: no noise


def model(arch: str):
    return build_model_on_meta(tiny_model_config(arch, vocab_size=64))


def test_the_defaults_select_each_layers_post_attention_norm():
    selected = select_weights(model("qwen2"), ["post_attention_layernorm"], ["input_layernorm"], ["rmsnorm"])
    layers = tiny_model_config("qwen2", vocab_size=64).num_hidden_layers
    assert sorted(selected) == [f"model.layers.{i}.post_attention_layernorm.weight" for i in range(layers)]


def test_a_json_list_in_a_string_is_a_list_not_its_characters():
    assert pattern_list('["experts","mlp"]', "key") == ["experts", "mlp"]
    assert pattern_list(['["experts","mlp"]'], "key") == ["experts", "mlp"]
    assert pattern_list(["mlp"], "key") == ["mlp"]


def test_linear_selects_the_mlp_weights_of_a_moe_model_and_excludes_come_first():
    moe = model("qwen2_moe")
    selected = select_weights(moe, ["mlp"], ["shared_expert_gate"], ["linear"])
    assert selected and all(".mlp." in name for name in selected)
    assert not any("shared_expert_gate" in name for name in selected)


def test_the_seeds_list_selects_no_norm_and_stops_naming_what_linear_would_select():
    cfg = load_config(["trainer.noise_injection.enabled=true", "trainer.noise_injection.target_modules=[experts,mlp]"])
    with pytest.raises(UserError) as error:
        build_noise_injection(cfg.trainer.noise_injection, model("qwen2_moe"), total_steps=100, seed=0)
    message = str(error.value)
    assert "selects no weight of this model: target_modules=['experts', 'mlp']" in message
    assert "post_attention_layernorm" in message and "With layer_types including linear they would select" in message


def test_noise_is_new_tensors_of_the_right_size_on_selected_weights_only_and_seeded():
    cfg = load_config(["trainer.noise_injection.enabled=true"])
    noise = build_noise_injection(cfg.trainer.noise_injection, model("qwen2"), total_steps=100, seed=3)
    name = next(iter(noise.weights))
    weight, other = torch.ones(4096), torch.ones(4096)
    bucket = [(name, weight), ("model.norm.weight", other)]
    noisy = dict(noise.apply(bucket, step=50))
    assert torch.equal(weight, torch.ones(4096)) and noisy["model.norm.weight"] is other  # nothing in place
    drawn = noisy[name] - 1
    assert drawn.std().item() == pytest.approx(noise.sigma(50), rel=0.1)
    assert torch.equal(dict(noise.apply(bucket, step=50))[name], noisy[name])  # same seed and step, same noise
    assert not torch.equal(dict(noise.apply(bucket, step=51))[name], noisy[name])  # fresh at every step
    assert dict(noise.apply(bucket, step=5))[name] is weight  # the first stage is clean
    metrics = noise.metrics(50)
    assert metrics["noise/tensors"] == len(noise.weights) and metrics["noise/sigma"] == noise.sigma(50)
