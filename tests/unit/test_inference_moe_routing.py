"""MoE routing and expert compute of ember's engine against direct per-token references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.inference.models.decoder import DecoderSpec
from ember.inference.models.moe import Experts, route_tokens
from ember.models.tiny import tiny_model_config


def reference_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> list[dict[int, float]]:
    """Per token: {expert: weight} of the top_k most probable experts, computed one token at a time."""
    routes = []
    for row in logits.double():
        probabilities = (row - row.max()).exp() / (row - row.max()).exp().sum()
        chosen = sorted(range(len(row)), key=lambda expert: -float(probabilities[expert]))[:top_k]
        total = sum(float(probabilities[expert]) for expert in chosen) if renormalize else 1.0
        routes.append({expert: float(probabilities[expert]) / total for expert in chosen})
    return routes


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_tokens_picks_the_top_k_experts_with_their_softmax_weights(renormalize):
    torch.manual_seed(0)
    logits = torch.randn(32, 8) * 3

    routing = route_tokens(logits, top_k=2, renormalize=renormalize)

    assert routing.weights.dtype == torch.float32 and routing.expert_ids.shape == (32, 2)
    for token, expected in enumerate(reference_routing(logits, 2, renormalize)):
        ids = routing.expert_ids[token].tolist()
        assert ids == list(expected)  # the chosen experts, most probable first
        assert routing.weights[token].tolist() == pytest.approx([expected[expert] for expert in ids], abs=1e-6)
    sums = routing.weights.sum(dim=-1)
    assert torch.allclose(sums, torch.ones(32)) == renormalize


def test_route_tokens_of_half_precision_logits_weigh_in_float32():
    torch.manual_seed(1)
    logits = torch.randn(16, 8, dtype=torch.bfloat16) * 3
    routing = route_tokens(logits, top_k=2, renormalize=False)
    assert routing.weights.dtype == torch.float32
    for token, expected in enumerate(reference_routing(logits.float(), 2, renormalize=False)):
        assert routing.weights[token].tolist() == pytest.approx(list(expected.values()), abs=1e-6)


def test_experts_equal_a_loop_over_tokens_and_their_chosen_experts():
    torch.manual_seed(0)
    num_experts, hidden, intermediate, top_k = 8, 16, 8, 3
    experts = Experts(num_experts, hidden, intermediate)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    states = torch.randn(12, hidden)
    logits = torch.randn(12, num_experts)
    logits[:, 5] = -1e4  # one expert gets no tokens at all
    routing = route_tokens(logits, top_k, renormalize=True)

    output = experts(states, routing)

    gate, up = experts.gate_up_proj.split(intermediate, dim=1)
    for token in range(12):
        x = states[token]
        expected = sum(
            routing.weights[token, k] * (experts.down_proj[e] @ (F.silu(gate[e] @ x) * (up[e] @ x)))
            for k, e in enumerate(routing.expert_ids[token].tolist())
        )
        torch.testing.assert_close(output[token], expected, atol=1e-4, rtol=1e-4)


def test_per_expert_views_write_into_the_fused_tensors():
    experts = Experts(num_experts=4, hidden_size=8, intermediate_size=8)
    torch.nn.init.zeros_(experts.gate_up_proj)
    views = experts.per_expert_views()
    views["gate_up_proj"]["2.up_proj.weight"].fill_(7.0)
    views["down_proj"]["1.down_proj.weight"].fill_(3.0)
    assert (experts.gate_up_proj[2, 8:] == 7.0).all() and not (experts.gate_up_proj[2, :8] == 7.0).all()
    assert (experts.down_proj[1] == 3.0).all()
    assert len(views["gate_up_proj"]) == 8 and len(views["down_proj"]) == 4


@pytest.mark.parametrize(
    ("arch", "overrides", "sparse"),
    [
        ("qwen2_moe", dict(num_hidden_layers=4, mlp_only_layers=[2]), (True, True, False, True)),
        ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2), (False, True, False, True)),
        ("qwen3_moe", dict(num_hidden_layers=2, num_experts=0), (False, False)),
        ("qwen3", dict(num_hidden_layers=2), (False, False)),
    ],
)
def test_spec_marks_sparse_layers_as_decoder_sparse_step_and_mlp_only_layers_say(arch, overrides, sparse):
    spec = DecoderSpec.from_hf_config(tiny_model_config(arch, vocab_size=64, **overrides))
    assert spec.sparse_layers == sparse


def test_spec_switches_of_the_moe_families():
    qwen2_moe = DecoderSpec.from_hf_config(tiny_model_config("qwen2_moe", vocab_size=64))
    qwen3_moe = DecoderSpec.from_hf_config(tiny_model_config("qwen3_moe", vocab_size=64))
    assert (qwen2_moe.qkv_bias, qwen2_moe.output_bias, qwen2_moe.query_key_norm, qwen2_moe.shared_expert) == (
        True, False, False, True)
    assert (qwen3_moe.qkv_bias, qwen3_moe.output_bias, qwen3_moe.query_key_norm, qwen3_moe.shared_expert) == (
        False, False, True, False)
    windowed = tiny_model_config("qwen3_moe", vocab_size=64, use_sliding_window=True, sliding_window=32)
    assert DecoderSpec.from_hf_config(windowed).sliding_windows == (32, 32)
