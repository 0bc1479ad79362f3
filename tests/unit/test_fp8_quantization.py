"""FP8 quantisation's numbers (`ember/inference/models/fp8.py`): per-row scales exact, every entry within
e4m3's rounding, the reference product equal to the dequantised matmul, and the settings it refuses."""

import pytest
import torch

from ember.inference import EngineConfig
from ember.inference.models.fp8 import (FP8_DTYPE, FP8_MAX, check_supported, dequantize_rows, quantize_rows,
                                        scaled_linear)


def test_rows_round_trip_within_e4m3_rounding_with_exact_per_row_scales():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=generator) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different sizes
    rows[5] = 0.0
    quantized, scales = quantize_rows(rows)

    assert quantized.dtype == FP8_DTYPE and scales.dtype == torch.float32 and scales.shape == (64,)
    amax = rows.abs().amax(dim=-1)
    assert torch.equal(scales[amax > 0], amax[amax > 0] / FP8_MAX)
    assert torch.equal(quantized.float().abs().amax(dim=-1)[amax > 0], torch.full((63,), FP8_MAX))  # each row's peak
    restored = dequantize_rows(quantized, scales)
    assert torch.equal(restored[5], torch.zeros(256))
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values; below 2^-6 (e4m3's smallest
    # normal) the step is absolute, 2^-9 in scaled units
    bound = torch.maximum(rows.abs() * 2**-4, scales[:, None] * 2**-10)
    assert ((restored - rows).abs() <= bound).all()
    assert (restored - rows).abs().max() > 0  # it does round


def test_scaled_linear_equals_the_matmul_of_dequantised_inputs_and_weights():
    generator = torch.Generator().manual_seed(1)
    states, weight, bias = (torch.randn(5, 3, 32, generator=generator), torch.randn(48, 32, generator=generator),
                            torch.randn(48, generator=generator))
    weight_q, weight_scales = quantize_rows(weight)
    inputs_q, input_scales = quantize_rows(states.reshape(-1, 32))
    expected = (dequantize_rows(inputs_q, input_scales) @ dequantize_rows(weight_q, weight_scales).t() + bias)

    output = scaled_linear(states, weight_q, weight_scales, bias)

    assert output.shape == (5, 3, 48)
    torch.testing.assert_close(output.reshape(-1, 48), expected, rtol=1e-5, atol=1e-5)
    exact = states @ weight.t() + bias
    assert 0 < (output - exact).abs().max() < 0.1 * exact.abs().max()


def test_quantization_other_than_fp8_is_refused_naming_the_values():
    with pytest.raises(ValueError, match="quantization='int8'.*fp8"):
        EngineConfig(quantization="int8")
    check_supported(torch.device("cpu"), torch.float32)  # the reference path runs anywhere off CUDA


def test_gpus_without_fp8_matmuls_other_dtypes_and_unaligned_widths_are_refused_naming_the_key(monkeypatch):
    from ember.inference.models.decoder import DecoderForCausalLM
    from ember.inference.models.fp8 import quantize_linears
    from ember.models.tiny import tiny_model_config

    cuda, key = torch.device("cuda"), "actor_rollout_ref.rollout.quantization=null"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=f"compute capability 8.9\\+.*this one is 8.0: set {key}"):
        check_supported(cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_supported(cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype is torch.float16: set actor_rollout_ref.rollout.dtype=bfloat16"):
        check_supported(cuda, torch.float16)
    with torch.device("meta"):
        model = DecoderForCausalLM(tiny_model_config("llama", vocab_size=128, intermediate_size=100), 64)
    with pytest.raises(ValueError, match=f"gate_proj of shape \\(100, 64\\).*multiples of 16; set {key}"):
        quantize_linears(model, cuda)
    quantize_linears(model, torch.device("cpu"))  # the reference path takes any width


def test_verls_rollout_quantization_key_reaches_the_engine_and_is_refused_off_embers_engine():
    from ember.config import ConfigError, load_config
    from ember.trainer.rank_setup import engine_config

    key = "actor_rollout_ref.rollout.quantization"
    config = load_config([f"{key}=fp8", "actor_rollout_ref.rollout.name=vllm"])  # a verl script's: ember's engine
    assert engine_config(config.actor_rollout_ref.rollout).quantization == "fp8"
    with pytest.raises(ConfigError, match=f"{key}=fp8 quantises ember's own engine.*rollout.name=ember instead of hf"):
        load_config([f"{key}=fp8", "actor_rollout_ref.rollout.name=hf"])
    with pytest.raises(ConfigError, match=f"invalid value for {key}: 'int8' \\(expected one of: fp8"):
        load_config([f"{key}=int8"])
    with pytest.raises(ConfigError, match=f"{key}_config_file='/q.json'.*one scale per output channel"):
        load_config([f"+{key}_config_file=/q.json"])  # verl's block-quantisation file: not what ember runs
