"""FP8 generation (`actor_rollout_ref.rollout.quantization=fp8`, verl's key): the decoder's linear layers
held as float8 e4m3 with one fp32 scale per output channel, their inputs quantised per token at run time.

What is quantised: q/k/v/o of every attention and gate/up/down of every dense MLP and shared expert
(`QUANTIZED_PROJECTIONS`), fused or not. Never: the embedding, the norms, the MoE router and the
shared expert's gate (they decide routing), the routed experts (grouped matmuls; they stay in the
generation dtype), the LM head (its logits are the sampled distribution).

The numbers: a weight row w is stored as e4m3(w / s) with s = max|w| / 448 in fp32, so its largest
entry is exactly ±448 and every entry is within e4m3's relative rounding (2^-4) of w / s. At run
time each token's input row x is quantised the same way (its own scale, computed on the device:
no host sync, so a decode step stays capturable in a CUDA graph), and
y = (e4m3(x / s_x) · e4m3(w / s_w)ᵀ) · s_x · s_w + b, accumulated in fp32. On CUDA devices of compute
capability 8.9+ the product is one `torch._scaled_mm` (row-wise scales, bf16 out); elsewhere the same
quantised values are multiplied in fp32 (`reference_scaled_matmul`), so CPU tests see the rounding a
GPU run has, up to the order of the fp32 sums.

The one thing to know: weights are quantised as they load (`quantize_on_the_way`, inside
`weights.load_weights`), in place, row by row of each arriving tensor; no copy in the generation
dtype is kept, so a synced bucket is dropped as before and captured graphs keep reading the same
memory. Under tensor parallelism each rank quantises its own part (per-row scales need no other rank).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.inference.models.compiled import compiled_on_cuda

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
"""448: the largest e4m3 value; each row's largest entry is scaled to it."""
MIN_SCALE = torch.finfo(torch.float32).tiny
"""Scale of an all-zero row (any positive value maps zeros to zeros)."""
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Names of the linear layers FP8 generation quantises, wherever they sit in the decoder."""
QUANTIZATIONS = ("fp8",)
"""Values of rollout.quantization besides null."""
_SCALED_MM_CAPABILITY = (8, 9)
_SCALED_MM_ALIGNMENT = 16


@compiled_on_cuda
def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 rows, fp32 scale per row) of a 2-D tensor: row i is e4m3(rows[i] / scale[i]) with
    scale[i] = max|rows[i]| / 448; the source is never written. One kernel on CUDA (the per-token activations)."""
    scales = (rows.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(MIN_SCALE)
    scaled = rows.to(torch.float32, copy=True).div_(scales[..., None]).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE), scales


def dequantize_rows(quantized: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values e4m3 rows with their per-row scales stand for, in `dtype`."""
    return (quantized.float() * scales[..., None]).to(dtype)


def reference_scaled_matmul(inputs: Tensor, input_scales: Tensor, weight: Tensor, weight_scales: Tensor,
                            dtype: torch.dtype) -> Tensor:
    """What `torch._scaled_mm` computes with row-wise scales: products of e4m3 values summed in fp32, then
    scaled by each input row's and each weight row's scale, in `dtype`."""
    products = inputs.float() @ weight.float().t()
    return (products * input_scales[:, None] * weight_scales[None, :]).to(dtype)


def scaled_linear(states: Tensor, weight: Tensor, weight_scales: Tensor, bias: Tensor | None) -> Tensor:
    """states @ weightᵀ + bias for an e4m3 `weight` (out, in) with per-row `weight_scales`, `states`
    quantised per token first; in `states`' dtype."""
    rows = states.reshape(-1, states.shape[-1])
    inputs, input_scales = quantize_rows(rows)
    if states.is_cuda:
        output = torch._scaled_mm(inputs, weight.t(), scale_a=input_scales[:, None], scale_b=weight_scales[None, :],
                                  out_dtype=states.dtype)
    else:
        output = reference_scaled_matmul(inputs, input_scales, weight, weight_scales, states.dtype)
    if bias is not None:
        output = output + bias
    return output.reshape(*states.shape[:-1], weight.shape[0])


def linear(states: Tensor, weight: Tensor, bias: Tensor | None, weight_scales: Tensor | None) -> Tensor:
    """`F.linear`, or `scaled_linear` where the weight is FP8 (`weight_scales` given): the projections'
    one entry point, fused or not."""
    if weight_scales is None:
        return F.linear(states, weight, bias)
    return scaled_linear(states, weight, weight_scales, bias)


class Fp8Linear(nn.Module):
    """A linear layer whose weight is e4m3 (the checkpoint's name, `weight`) with an fp32 scale per
    output row (`weight_scale`, a buffer: never sent, computed from each weight as it loads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32), persistent=False)

    def forward(self, states: Tensor) -> Tensor:
        return scaled_linear(states, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse FP8 on a GPU without FP8 matmuls (the reference path there would be slower than no
    quantization) or in another dtype than bfloat16 there; any device other than CUDA runs the reference."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < _SCALED_MM_CAPABILITY:
        raise ValueError(
            f"actor_rollout_ref.rollout.quantization=fp8 needs a GPU of compute capability 8.9+ (Ada, Hopper) for "
            f"FP8 matmuls; this one is {capability[0]}.{capability[1]}: set actor_rollout_ref.rollout.quantization=null")
    if dtype != torch.bfloat16:
        raise ValueError(
            f"actor_rollout_ref.rollout.quantization=fp8 computes in bfloat16 on GPUs, the engine's dtype is {dtype}: "
            "set actor_rollout_ref.rollout.dtype=bfloat16 (or auto)")


def quantize_linears(model: nn.Module, device: torch.device) -> None:
    """Replace every linear named in QUANTIZED_PROJECTIONS by an `Fp8Linear` of its shape (call it on the
    meta device, before the model is materialised, so no full-precision copy ever exists)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in QUANTIZED_PROJECTIONS or not isinstance(child, nn.Linear):
                continue
            if device.type == "cuda" and (child.in_features % _SCALED_MM_ALIGNMENT
                                          or child.out_features % _SCALED_MM_ALIGNMENT):
                raise ValueError(
                    f"{name} of shape ({child.out_features}, {child.in_features}) on this rank: FP8 matmuls need both "
                    f"sizes to be multiples of {_SCALED_MM_ALIGNMENT}; set actor_rollout_ref.rollout.quantization=null "
                    "for this model (or another rollout.tensor_model_parallel_size)")
            setattr(module, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None))


def quantized_weights(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """Each FP8 weight's checkpoint name -> (its e4m3 storage, its scales); views of a fused weight where fused."""
    return {f"{name}.weight": (module.weight.data, module.weight_scale)
            for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


def quantize_into(weight: Tensor, scales: Tensor, source: Tensor) -> None:
    """Quantise `source` (any float dtype and device) row by row into the e4m3 `weight` and its `scales`, in place."""
    with torch.no_grad():
        quantized, source_scales = quantize_rows(source.to(weight.device))
        weight.copy_(quantized)
        scales.copy_(source_scales)


def quantize_on_the_way(named_tensors: Iterable[tuple[str, Tensor]], targets: dict[str, tuple[Tensor, Tensor]],
                        loaded: set[str]) -> Iterator[tuple[str, Tensor]]:
    """Quantise each tensor that has an FP8 place in `targets` into it as it arrives (adding its name to
    `loaded`), passing the rest on; a weight of the wrong shape is refused by name."""
    for name, tensor in named_tensors:
        if name not in targets:
            yield name, tensor
            continue
        weight, scales = targets[name]
        if tensor.shape != weight.shape:
            raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)}, ember's engine has "
                             f"{tuple(weight.shape)}: send full (unsharded) tensors of the same model")
        quantize_into(weight, scales, tensor)
        loaded.add(name)
