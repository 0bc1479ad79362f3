"""The decoder's small building blocks, each one kernel on CUDA: RMSNorm (fused with the residual add), RoPE, SwiGLU;
and `fuse_linears`, which turns several projections of one input into one matrix product (FP8 ones too, `fp8.py`).

A decode step does little arithmetic per kernel, so its time goes to the number of kernels
more than to their work. On CUDA the norms and SwiGLU's gating are one Triton kernel each
(`kernels/norm_act.py`: no dynamo at start-up, no guard checks per call), and the RoPE
fallback (head sizes the fused RoPE + cache kernel does not take) is compiled with
`torch.compile` (dynamic shapes: one compilation serves every batch size and prefill);
on other devices they run eagerly. The math is HF's: RMSNorm in float32 scaled after
casting back, RoPE in float32 ("rotate half").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.inference.models.compiled import compiled_on_cuda
from ember.inference.models.fp8 import Fp8Linear, linear


def _rms_norm(states: Tensor, weight: Tensor, eps: float) -> Tensor:
    as_float = states.float()
    normalized = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(states.dtype)


def rms_norm(states: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * RMSNorm(states) over the last dim."""
    if states.is_cuda:
        from ember.inference.kernels import norm_act

        return norm_act.rms_norm(states, weight, eps)[0]
    return _rms_norm(states, weight, eps)


def add_rms_norm(states: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(states + residual), states + residual): a block's output joins the residual stream and is normed.
    States of another dtype than the residual (a tensor-parallel block's float32 sum) are rounded to it first, in
    the same kernel on CUDA."""
    if states.is_cuda:
        from ember.inference.kernels import norm_act

        return norm_act.rms_norm(states, weight, eps, residual=residual)
    summed = states.to(residual.dtype) + residual
    return _rms_norm(summed, weight, eps), summed


@compiled_on_cuda
def rotate_queries_keys(queries: Tensor, keys: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate (tokens, heads, head_dim) queries and keys by their tokens' positions; cos/sin: (positions, head_dim)."""
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    return _rotate(queries, cos, sin), _rotate(keys, cos, sin)


def _rotate(states: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = states.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (states.float() * cos + rotated_half.float() * sin).to(states.dtype)


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, SwiGLU's gating."""
    if gate.is_cuda:
        from ember.inference.kernels import norm_act

        return norm_act.silu_and_mul(gate, up)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight (HF's LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, states: Tensor) -> Tensor:
        return rms_norm(states, self.weight, self.eps)

    def add_and_norm(self, states: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(states + residual), states + residual)."""
        return add_rms_norm(states, residual, self.weight, self.eps)


def fuse_linears(owner: nn.Module, names: Sequence[str]) -> tuple[Tensor, Tensor | None, Tensor | None, list[str]]:
    """One weight (and bias, and FP8 row scales where the linears are `Fp8Linear`s) computing the `owner`'s
    linears `names` (of the same input) in one matrix product, their outputs side by side in the given order;
    and the parameter names (under `owner`) that became views.

    Each linear keeps its parameters under its own name, now views of the fused tensors: a
    weight loaded by its checkpoint name (copied, or quantised, in place) fills its rows of the fused one.
    """
    linears = [getattr(owner, name) for name in names]
    has_bias = linears[0].bias is not None
    if any((linear.bias is not None) != has_bias or linear.in_features != linears[0].in_features
           or linear.weight.dtype != linears[0].weight.dtype for linear in linears):
        raise ValueError("fuse_linears needs projections of one input with the same dtype, all with or all without bias")
    weight = torch.cat([linear.weight.data for linear in linears])
    bias = torch.cat([linear.bias.data for linear in linears]) if has_bias else None
    scales = torch.cat([linear.weight_scale for linear in linears]) if isinstance(linears[0], Fp8Linear) else None
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        linear.weight.data = weight[rows]
        if has_bias:
            linear.bias.data = bias[rows]
        if scales is not None:
            linear.weight_scale = scales[rows]
        start = rows.stop
    views = [f"{name}.{kind}" for name, linear in zip(names, linears) for kind, _ in linear.named_parameters()]
    return weight, bias, scales, views


class PartialSumLinear(nn.Linear):
    """A projection split by its input width over rollout tensor-parallel ranks (attention's output
    projection, an MLP's down projection): this rank's product is one partial sum of the whole one. In
    bf16/fp16 on a GPU it comes back in fp32 (cuBLAS accumulates in fp32 anyway), so the group sums
    unrounded partials and the block's output is rounded to bf16 once, as the unsplit product is: rounding
    each partial and summing in bf16 moved a 135M model's log-probs by up to 0.1 nats at TP=3."""

    def forward(self, states: Tensor) -> Tensor:
        if states.is_cuda and states.dtype in (torch.bfloat16, torch.float16):
            product = torch.mm(states.reshape(-1, self.in_features), self.weight.t(), out_dtype=torch.float32)
            if self.bias is not None:
                product += self.bias
            return product.view(*states.shape[:-1], self.out_features)
        return super().forward(states)


def output_projection(in_features: int, out_features: int, bias: bool, split: bool) -> nn.Linear:
    """A block's last projection: a `PartialSumLinear` when its input width is `split` over several ranks."""
    return (PartialSumLinear if split else nn.Linear)(in_features, out_features, bias=bias)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); gate and up one matrix product once fused. `split`:
    the intermediate width is this rank's share (rollout tensor parallelism), the output a partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, split: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = output_projection(intermediate_size, hidden_size, bias, split)
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.register_buffer("gate_up_weight_scale", None, persistent=False)

    def fuse_projections(self) -> list[str]:
        """Compute gate and up in one matrix product from now on; returns the parameters that became views."""
        self.gate_up_weight, self.gate_up_bias, self.gate_up_weight_scale, views = fuse_linears(
            self, ("gate_proj", "up_proj"))
        return views

    def forward(self, states: Tensor) -> Tensor:
        if self.gate_up_weight is None:
            gate, up = self.gate_proj(states), self.up_proj(states)
        else:
            gate, up = linear(states, self.gate_up_weight, self.gate_up_bias, self.gate_up_weight_scale).chunk(2, dim=-1)
        return self.down_proj(silu_and_mul(gate, up))
