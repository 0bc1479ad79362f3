"""FP8 generation (rollout.quantization=fp8) in ember's engine on a tiny random fp32 model (CPU: the
reference matmul, the same quantised values a GPU's `_scaled_mm` multiplies).

The engine's greedy tokens and log-probs equal transformers' model with every projection replaced
by a hand-written fake quantisation (per-row e4m3 of weights and of each token's input); they differ
from the unquantised engine by a small, nonzero amount (dense and MoE: router and routed experts stay
unquantised); wrong scales break the equality; a weight
update quantises the new weights (fused projections included), AQN's noise is quantised with the
weights it is added to, and a GRPO step with rollout.quantization=fp8 logs the mismatch FP8 adds in
rollout correction's metrics. A split replica (TP=2) is tested in test_rollout_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.inference import EngineConfig, LLMEngine
from ember.inference.models.fp8 import FP8_DTYPE, QUANTIZED_PROJECTIONS, Fp8Linear
from ember.rollout.base import SamplingParams
from ember.workers.noise_injection import NoiseInjection
from rl_helpers import build_trainer, fit, metrics_by_step, run_overrides
from test_inference_engine import hf_greedy, tiny_model
from test_inference_moe import tiny_moe_model

NEW_TOKENS = 6


def prompts(count: int = 12, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (count,), generator=generator)
    return [torch.randint(0, 128, (int(length),), generator=generator).tolist() for length in lengths]


def fp8_engine(model, quantization: str | None = "fp8", fuse: bool = False) -> LLMEngine:
    config = EngineConfig(max_model_len=32, max_num_seqs=12, max_num_batched_tokens=128, block_size=4,
                          dtype=torch.float32, quantization=quantization, fuse_projections=fuse)
    return LLMEngine(model.config, model.state_dict().items(), config)


def generate(engine: LLMEngine, prompt_ids: list[list[int]]):
    outputs = engine.generate(prompt_ids, SamplingParams(do_sample=False, max_new_tokens=NEW_TOKENS))
    return [output.generated_token_ids for output in outputs], [output.log_probs for output in outputs]


def fake_quantized(tensor: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 round trip written independently of ember: scale max|row| / 448."""
    scale = tensor.abs().amax(-1, keepdim=True) / 448
    return (tensor / scale).to(torch.float8_e4m3fn).float() * scale


def with_fake_quantized_projections(model):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS:
            module.forward = lambda states, m=module: F.linear(fake_quantized(states), fake_quantized(m.weight), m.bias)
    return model


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
def test_fp8_engine_equals_a_fake_quantized_forward_and_wrong_scales_break_it(fuse):
    model = tiny_model("qwen2")  # q/k/v biases: the bias path of the FP8 product too
    prompt_ids = prompts()
    engine = fp8_engine(model, fuse=fuse)
    projections = [module for module in engine.model.modules() if isinstance(module, Fp8Linear)]
    assert len(projections) == 7 * model.config.num_hidden_layers
    assert all(module.weight.dtype == FP8_DTYPE for module in projections)
    assert engine.model.lm_head.weight.dtype == torch.float32  # the head and embedding stay unquantised
    tokens, log_probs = generate(engine, prompt_ids)

    reference = with_fake_quantized_projections(tiny_model("qwen2"))
    expected = [teacher_forced(reference, prompt, response) for prompt, response in zip(prompt_ids, tokens)]
    errors = torch.cat([(torch.tensor(got) - want).abs() for got, want in zip(log_probs, expected)])
    assert errors.max() < 2e-3
    assert tokens == [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompt_ids]

    for module in projections[:7]:  # one layer's scales 25% off
        module.weight_scale.mul_(1.25)
    wrong = generate(engine, prompt_ids)[1]
    wrong_errors = torch.cat([(torch.tensor(got[:1]) - want[:1]).abs() for got, want in zip(wrong, expected)])
    assert wrong_errors.mean() > 20 * errors.mean() and wrong_errors.max() > 10 * 2e-3


def test_fp8_tokens_mostly_equal_the_unquantized_engine_with_close_but_different_log_probs():
    model = tiny_model("llama")
    prompt_ids = prompts(count=24, seed=2)
    exact_tokens, exact = generate(fp8_engine(model, quantization=None), prompt_ids)
    fp8_tokens, quantized = generate(fp8_engine(model), prompt_ids)

    same_first = [a[0] == b[0] for a, b in zip(exact_tokens, fp8_tokens)]
    assert sum(same_first) >= 0.8 * len(prompt_ids)
    gaps = torch.tensor([abs(a[0] - b[0]) for a, b, same in zip(exact, quantized, same_first) if same])
    assert 1e-3 < gaps.mean() < 0.15  # quantised (not skipped), and close (scales right)


def test_moe_layers_quantize_attention_and_the_shared_expert_but_not_the_router_or_routed_experts():
    model = tiny_moe_model("qwen2_moe")
    prompt_ids = prompts(count=12, seed=3)
    engine = fp8_engine(model)
    sparse = engine.model.model.layers[0].mlp
    assert sparse.experts.gate_up_proj.dtype == sparse.gate.weight.dtype == sparse.shared_expert_gate.weight.dtype
    assert sparse.gate.weight.dtype == torch.float32 and sparse.shared_expert.down_proj.weight.dtype == FP8_DTYPE
    assert engine.model.model.layers[1].mlp.up_proj.weight.dtype == FP8_DTYPE  # the dense layer's MLP

    exact_tokens, exact = generate(fp8_engine(model, quantization=None), prompt_ids)
    fp8_tokens, quantized = generate(engine, prompt_ids)
    same_first = [a[0] == b[0] for a, b in zip(exact_tokens, fp8_tokens)]
    assert sum(same_first) >= 0.75 * len(prompt_ids)
    gaps = torch.tensor([abs(a[0] - b[0]) for a, b, same in zip(exact, quantized, same_first) if same])
    assert 1e-4 < gaps.mean() < 0.15


def test_a_weight_update_quantizes_the_new_weights_in_place():
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    prompt_ids = prompts(count=4)
    engine = fp8_engine(first, fuse=True)
    fused = engine.model.model.layers[0].self_attn.qkv_weight
    before = generate(engine, prompt_ids)
    engine.load_weights(second.named_parameters())
    after = generate(engine, prompt_ids)

    assert after != before
    assert after == generate(fp8_engine(second, fuse=True), prompt_ids)
    assert engine.model.model.layers[0].self_attn.qkv_weight.data_ptr() == fused.data_ptr()  # graphs stay valid
    assert all(parameter.dtype in (FP8_DTYPE, torch.float32) for parameter in engine.model.parameters())


def test_fp8_weights_take_a_quarter_of_fp32_and_no_full_precision_copy_is_kept():
    model = tiny_model("llama")
    exact, quantized = fp8_engine(model, quantization=None), fp8_engine(model)

    def projection_bytes(engine):
        tensors = [*engine.model.named_parameters(), *engine.model.named_buffers()]
        return sum(tensor.nbytes for name, tensor in tensors if name.split(".")[-2] in QUANTIZED_PROJECTIONS)

    rows = sum(module.out_features for module in quantized.model.modules() if isinstance(module, Fp8Linear))
    assert projection_bytes(quantized) == projection_bytes(exact) // 4 + 4 * rows  # e4m3 + one fp32 scale per row


def test_aqn_noise_is_quantised_with_the_weights_it_is_added_to():
    model = tiny_model("llama")
    weights = dict(model.state_dict())
    noise = NoiseInjection(weights={name: tensor.numel() for name, tensor in weights.items() if "proj" in name},
                           total_steps=4, sigma_start=0.05, sigma_end=0.01, num_stages=2, seed=7)
    noised = dict(noise.apply(list(weights.items()), step=3))
    engine = fp8_engine(model)
    clean = generate(engine, prompts(count=4))
    engine.load_weights(noised.items())

    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(engine.model.get_submodule(name).weight_scale, noised[f"{name}.weight"].abs().amax(dim=1) / 448)
    noisy = generate(engine, prompts(count=4))
    assert noisy == generate(LLMEngine(model.config, noised.items(), engine.config), prompts(count=4))
    assert noisy != clean


def test_a_grpo_step_with_fp8_rollout_logs_the_mismatch_fp8_adds(inputs, tmp_path):
    mismatch = {}
    for quantization in ("null", "fp8"):
        overrides = run_overrides(inputs, tmp_path / quantization, "trainer.total_training_steps=1",
                                  "trainer.val_before_train=False", "trainer.test_freq=-1",
                                  "actor_rollout_ref.rollout.name=ember",
                                  f"actor_rollout_ref.rollout.quantization={quantization}")
        fit(build_trainer(overrides))
        mismatch[quantization] = metrics_by_step(tmp_path / quantization)[1]["rollout_corr/log_prob_abs_diff_mean"]
    assert mismatch["null"] < 1e-6  # fp32 engine and fp32 actor agree
    assert 1e-4 < mismatch["fp8"] < 0.1
