"""FP8 generation (rollout.quantization=fp8) in ember's engine on a tiny random fp32 model (CPU: the
reference matmul, the same quantised values a GPU's `_scaled_mm` multiplies).

The engine's greedy tokens and log-probs equal transformers' model with every projection replaced
by a hand-written fake quantisation (per-row e4m3 of weights and of each token's input); they differ
from the unquantised engine by a small, nonzero amount; wrong scales break the equality; a weight
update quantises the new weights (fused projections included), and a split replica (TP=2) is
tested in test_rollout_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.inference import EngineConfig, LLMEngine
from ember.inference.models.fp8 import FP8_DTYPE, QUANTIZED_PROJECTIONS, Fp8Linear
from ember.rollout.base import SamplingParams
from test_inference_engine import hf_greedy, tiny_model

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
