"""The engine's residual add + RMSNorm (`models/layers.add_rms_norm`, the PyTorch path the CUDA kernel must equal):
a tensor-parallel block's float32 sum joins a bf16 residual stream rounded to bf16 first, as a block's output
rounded on its own would."""

from __future__ import annotations

import torch

from ember.inference.models.layers import add_rms_norm


def test_a_float32_block_sum_is_rounded_to_the_residuals_dtype_before_the_add():
    torch.manual_seed(0)
    block_sum = torch.randn(5, 48) * 3
    residual = torch.randn(5, 48).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(48)).to(torch.bfloat16)
    normed, summed = add_rms_norm(block_sum, residual, weight, 1e-5)
    expected_normed, expected_summed = add_rms_norm(block_sum.to(torch.bfloat16), residual, weight, 1e-5)
    assert summed.dtype == normed.dtype == torch.bfloat16
    assert torch.equal(summed, expected_summed) and torch.equal(normed, expected_normed)
    assert not torch.equal(summed, (block_sum + residual.float()).to(torch.bfloat16))  # one rounding fewer differs
