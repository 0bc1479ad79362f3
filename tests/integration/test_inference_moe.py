"""ember's generation engine on tiny random fp32 MoE models (Qwen2-MoE, Qwen3-MoE), checked against transformers.

Each model has 8 experts with top-2 routing and at least one dense layer (mlp_only_layers),
so the sparse and the dense MLP both run; Qwen2-MoE keeps its shared expert and does not
renormalise the top-k weights, Qwen3-MoE renormalises them. Weights load from the HF
model's own (fused-expert) parameters and from a saved directory (one tensor per expert).
"""

from __future__ import annotations

import pytest
import torch
from test_inference_engine import PROMPTS, engine_config, hf_greedy, teacher_forced_log_probs, tiny_model
from transformers import PreTrainedModel

from ember.inference import LLMEngine
from ember.inference.models import SparseMoeBlock
from ember.inference.models.weights import read_safetensors
from ember.rollout.base import SamplingParams
from ember.rollout.ember_rollout import EmberRollout

MOE_OVERRIDES = {
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[2]),
}
MOE_ARCHS = list(MOE_OVERRIDES)


def tiny_moe_model(arch: str, seed: int = 0) -> PreTrainedModel:
    return tiny_model(arch, seed=seed, **MOE_OVERRIDES[arch])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_sparse_and_dense_layers_follow_the_hf_model(arch):
    model = tiny_moe_model(arch)
    engine = LLMEngine(model.config, model.named_parameters(), engine_config())
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in engine.model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert ours == theirs
    assert True in ours and False in ours


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_equals_transformers_with_refilled_slots_from_named_parameters(arch, fuse):
    model = tiny_moe_model(arch)
    expected = [hf_greedy(model, prompt, 64) for prompt in PROMPTS]
    # 5 prompts, 2 slots; fused: q/k/v, and gate/up of dense layers and of Qwen2-MoE's shared expert
    engine = LLMEngine(model.config, model.named_parameters(), engine_config(fuse_projections=fuse))

    outputs = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=64))

    assert [output.generated_token_ids for output in outputs] == expected
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_n_samples_equal_transformers_loaded_from_a_saved_directory(tmp_path, arch):
    model = tiny_moe_model(arch)
    model.save_pretrained(tmp_path)
    assert any(".experts.0.gate_proj.weight" in name for name, _ in read_safetensors(tmp_path))  # per-expert names
    rollout = EmberRollout(LLMEngine.from_pretrained(tmp_path, engine_config(max_num_seqs=4)))

    outputs = rollout.generate(PROMPTS, SamplingParams(n=2, do_sample=False, max_new_tokens=64))

    expected = [hf_greedy(model, prompt, 64) for prompt in PROMPTS]
    assert [output.prompt_index for output in outputs] == [index for index in range(len(PROMPTS)) for _ in range(2)]
    assert [output.token_ids for output in outputs] == [tokens for tokens in expected for _ in range(2)]


def test_update_weights_with_fused_experts_switches_models():
    first, second = tiny_moe_model("qwen3_moe", seed=0), tiny_moe_model("qwen3_moe", seed=1)
    rollout = EmberRollout(LLMEngine(first.config, first.named_parameters(), engine_config()))
    sampling = SamplingParams(do_sample=False, max_new_tokens=24)

    rollout.update_weights((name, tensor) for name, tensor in second.named_parameters() if ".experts." in name)
    mixed = [output.token_ids for output in rollout.generate(PROMPTS[:3], sampling)]
    rollout.update_weights(second.named_parameters())
    after = [output.token_ids for output in rollout.generate(PROMPTS[:3], sampling)]

    assert after == [hf_greedy(second, prompt, 24) for prompt in PROMPTS[:3]]
    assert mixed != after  # the experts alone changed the model, the rest came later


def test_a_checkpoint_missing_one_expert_fails_naming_the_fused_tensor(tmp_path):
    model = tiny_moe_model("qwen2_moe")
    model.save_pretrained(tmp_path)
    partial = [(name, tensor) for name, tensor in read_safetensors(tmp_path)
               if name != "model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lack 1 parameters.*model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        LLMEngine(model.config, partial, engine_config())


def test_bfloat16_log_probs_follow_the_transformers_forward():
    model = tiny_moe_model("qwen2_moe").to(torch.bfloat16)
    engine = LLMEngine(model.config, model.named_parameters(), engine_config(dtype=torch.bfloat16))
    outputs = EmberRollout(engine).generate(PROMPTS[:3], SamplingParams(do_sample=False, max_new_tokens=16))
    for output in outputs:
        expected = teacher_forced_log_probs(model, PROMPTS[output.prompt_index], output.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(output.log_probs), expected.float(), atol=0.1, rtol=0)
