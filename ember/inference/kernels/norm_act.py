"""RMSNorm (optionally fused with the residual add) and SwiGLU's gating, one Triton kernel each.

They replace the torch.compile'd versions of `models/layers.py` on CUDA: the same single kernel
per call, without dynamo at the engine's first step (tracing and guards on every launch's
start-up) or its guard checks on every prefill call. The arithmetic is the PyTorch reference's,
rounding where it rounds: the residual sum and silu(gate) are rounded to the activations' dtype,
the norm is computed in float32 and rounded before the weight's scale, each product in float32
and rounded once.

They must equal `layers._rms_norm`, `layers.add_rms_norm`'s eager body and `F.silu(gate) * up`
(tests/gpu compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(states_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, states_stride, residual_stride,
                     out_stride, summed_stride, columns, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    valid = offsets < columns
    states = tl.load(states_ptr + row * states_stride + offsets, mask=valid, other=0.0)
    activation_type = states.dtype
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + offsets, mask=valid, other=0.0)
        activation_type = residual.dtype  # float32 states (a tensor-parallel block's sum) are rounded to it first
        states = (states.to(activation_type).to(tl.float32) + residual.to(tl.float32)).to(activation_type)
        tl.store(summed_ptr + row * summed_stride + offsets, states, mask=valid)
    as_float = states.to(tl.float32)
    mean_square = tl.sum(as_float * as_float, axis=0) / columns
    normalized = (as_float * tl.math.rsqrt(mean_square + eps)).to(activation_type)
    weight = tl.load(weight_ptr + offsets, mask=valid, other=0.0)
    out = weight.to(tl.float32) * normalized.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offsets, out.to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(states: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(weight * rmsnorm(x), x) with x = states (+ residual) over the last dim of (..., hidden) tensors; the second
    item is the sum, None without a residual. With a residual, states of another dtype (a tensor-parallel block's
    float32 sum) are rounded to the residual's before the add. The output's dtype is PyTorch's promotion of
    weight and the activations (the residual's dtype, else the states')."""
    hidden = states.shape[-1]
    activations = residual if residual is not None else states
    if states.numel() == 0:
        summed = states.to(residual.dtype) + residual if residual is not None else None
        return torch.empty(states.shape, dtype=torch.result_type(weight, activations), device=states.device), summed
    rows = states.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, activations), device=states.device)
    summed = torch.empty(rows.shape, dtype=residual.dtype, device=rows.device) if residual is not None else None
    residual_rows = residual.reshape(-1, hidden).contiguous() if residual is not None else rows
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual_rows, weight, out, summed if summed is not None else out,
        rows.stride(0), residual_rows.stride(0), out.stride(0), summed.stride(0) if summed is not None else 0,
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    shape = states.shape
    return out.view(shape), summed.view(shape) if summed is not None else None


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, out_stride, columns, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < columns
    gate = tl.load(gate_ptr + row * gate_stride + offsets, mask=valid, other=0.0)
    up = tl.load(up_ptr + row * up_stride + offsets, mask=valid, other=0.0)
    as_float = gate.to(tl.float32)
    silu = (as_float / (1.0 + tl.exp(-as_float))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offsets, out.to(out_ptr.dtype.element_ty), mask=valid)


_SILU_BLOCK = 1024


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for (..., intermediate) tensors whose last dim is contiguous (the halves of a fused
    gate/up product are: their rows are strided)."""
    columns = gate.shape[-1]
    if gate.numel() == 0:
        return torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)
    gate_rows, up_rows = gate.reshape(-1, columns), up.reshape(-1, columns)
    if gate_rows.stride(-1) != 1 or up_rows.stride(-1) != 1:
        gate_rows, up_rows = gate_rows.contiguous(), up_rows.contiguous()
    out = torch.empty(gate_rows.shape, dtype=torch.result_type(gate, up), device=gate.device)
    grid = (gate_rows.shape[0], triton.cdiv(columns, _SILU_BLOCK))
    _silu_and_mul_kernel[grid](gate_rows, up_rows, out, gate_rows.stride(0), up_rows.stride(0), out.stride(0), columns,
                               BLOCK=_SILU_BLOCK)
    return out.view(gate.shape)
