"""FP8 generation on a GPU of compute capability 8.9+ (`torch._scaled_mm`, row-wise scales): the product
against the reference the CPU tests check, CUDA-graph decode steps against eager ones, tokens and log-probs
against the bf16 engine, and more KV blocks from the smaller weights."""

from __future__ import annotations

import pytest
import torch

from ember.inference import EngineConfig, LLMEngine
from ember.inference.models.fp8 import FP8_DTYPE, quantize_rows, reference_scaled_matmul, scaled_linear
from ember.rollout.base import SamplingParams
from test_inference_gpu import PROMPTS, model_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 matmuls need a GPU of compute capability 8.9+")]


def engine_for(model, **overrides) -> LLMEngine:
    settings = dict(max_model_len=160, max_num_seqs=6, max_num_batched_tokens=512, block_size=16,
                    dtype=torch.bfloat16, device="cuda", num_kv_blocks=256, quantization="fp8")
    return LLMEngine(model.config, model.state_dict().items(), EngineConfig(**dict(settings, **overrides)))


@pytest.mark.parametrize("rows", [1, 37, 512])
def test_scaled_mm_equals_the_reference_product_of_the_same_quantised_values(rows):
    torch.manual_seed(0)
    states = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    weight, weight_scales = quantize_rows(torch.randn(4864, 896, device="cuda", dtype=torch.bfloat16))
    inputs, input_scales = quantize_rows(states)
    expected = reference_scaled_matmul(inputs, input_scales, weight, weight_scales, torch.bfloat16)
    actual = scaled_linear(states, weight, weight_scales, None)
    assert weight.dtype == FP8_DTYPE and actual.dtype == torch.bfloat16
    # Products of about 30 in magnitude (up to 150): Hopper's FP8 matmul accumulates in fewer bits than fp32,
    # 0.023 apart at most on an H100; a wrong scale or transposed operand is off by whole units.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=0.05)


def test_fp8_graph_steps_equal_eager_steps_and_stay_close_to_bf16():
    model = model_of(torch.bfloat16)
    sampling = SamplingParams(do_sample=False, max_new_tokens=32)
    graphed = engine_for(model).generate(PROMPTS, sampling)
    eager = engine_for(model, use_cuda_graphs=False).generate(PROMPTS, sampling)
    bf16 = engine_for(model, quantization=None).generate(PROMPTS, sampling)
    assert [s.generated_token_ids for s in graphed] == [s.generated_token_ids for s in eager]
    same_first = [a.generated_token_ids[0] == b.generated_token_ids[0] for a, b in zip(graphed, bf16)]
    assert sum(same_first) >= 0.8 * len(PROMPTS)
    gaps = torch.tensor([abs(a.log_probs[0] - b.log_probs[0]) for a, b, same in zip(graphed, bf16, same_first) if same])
    assert 0 < gaps.mean() < 0.15


def test_fp8_weights_leave_room_for_more_kv_blocks():
    model = model_of(torch.bfloat16, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=2)
    sizes = {}
    for quantization in (None, "fp8"):
        engine = engine_for(model, num_kv_blocks=None, max_num_seqs=4096, max_model_len=4096,
                            gpu_memory_utilization=0.3, quantization=quantization)
        sizes[quantization] = engine.num_kv_blocks
        del engine
        torch.cuda.empty_cache()
    assert sizes["fp8"] > sizes[None]
