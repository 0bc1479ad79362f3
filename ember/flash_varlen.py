"""Causal attention over packed sequences on PyTorch's flash-attention varlen kernel
(`torch.nn.attention.varlen`), in whichever form this PyTorch release takes it.

Both the training engines' packed micro-batches (`engines/varlen_attention.py`, Megatron's
packed rows) and the generation engine's prefill of whole prompts (`inference/attention.py`)
attend this way: tokens flat as (tokens, heads, head_dim), sequences delimited by cumulative
lengths, each attending causally to itself alone. The kernel exists on CUDA in bf16/fp16 only.
Grouped-query heads reach it as they are (`enable_gqa`, or passed through where a one-time check
shows the kernel takes them), repeated per query head only where neither works.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch import Tensor


@functools.cache
def varlen_available() -> bool:
    """Whether PyTorch ships the flash-attention varlen kernel and a CUDA device is present (asked once:
    attention layers ask it on every call)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None and torch.cuda.is_available()


def runs_on_kernel(queries: Tensor, sliding_window: int | None = None) -> bool:
    """Whether `causal_varlen_attention` can take these (tokens, heads, dim) queries: CUDA, half precision, the
    kernel present on an Ampere or newer GPU, a head size the flash kernel has (a multiple of 8 up to 256), and
    a sliding window only where this PyTorch's kernel takes one."""
    head_dim = queries.shape[-1]
    return (queries.is_cuda and queries.dtype in (torch.bfloat16, torch.float16) and varlen_available()
            and _capability(queries.device.index) >= (8, 0) and head_dim % 8 == 0 and head_dim <= 256
            and (sliding_window is None or "window_size" in _varlen_parameters()))


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def causal_varlen_attention(queries: Tensor, keys: Tensor, values: Tensor, cu_seqlens: Tensor, max_length: int,
                            scale: float | None = None, sliding_window: int | None = None) -> Tensor:
    """(tokens, heads, dim) queries and (tokens, kv_heads, dim) keys/values of sequences packed back to back
    (`cu_seqlens`: their int32 cumulative lengths, `max_length`: the longest) → (tokens, heads, dim)."""
    from torch.nn.attention.varlen import varlen_attn

    arguments = _causal_arguments(scale, sliding_window, queries.shape[-1])
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1 and "enable_gqa" in _varlen_parameters():
        arguments["enable_gqa"] = True  # the kernel reads each key/value head for its group of query heads
    elif groups > 1 and not _groups_heads():
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return varlen_attn(queries, keys, values, cu_seqlens, cu_seqlens, max_length, max_length, **arguments)


def prepare() -> None:
    """Answer once, up front, what this PyTorch's kernel takes (before a compiled region calls it)."""
    _varlen_parameters()
    _groups_heads()


_GROUPS_HEADS: bool | None = None  # one answer per process, read as a plain global by compiled layers


def _groups_heads() -> bool:
    """Whether this PyTorch's `varlen_attn` takes fewer key/value heads than query heads (grouped-query
    attention, no repeated copies) without an `enable_gqa` switch. The flash kernel itself groups
    heads; releases without the switch pass the heads through or refuse them, which no signature
    tells, so it is asked once on a 6-token problem: outputs and all three gradients against
    repeated heads."""
    global _GROUPS_HEADS
    if _GROUPS_HEADS is None:
        with torch.inference_mode(False), torch.enable_grad():  # whatever mode the engine is built in
            _GROUPS_HEADS = "enable_gqa" not in _varlen_parameters() and _grouped_heads_match_repeated()
    return _GROUPS_HEADS


def _grouped_heads_match_repeated() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"query": (6, 4, 64), "key": (6, 2, 64), "value": (6, 2, 64)}
    inputs = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
              for name, shape in shapes.items()}
    cu = torch.tensor([0, 2, 6], device="cuda", dtype=torch.int32)
    arguments = _causal_arguments(None, None, 64)
    try:
        grouped = varlen_attn(inputs["query"], inputs["key"], inputs["value"], cu, cu, 4, 4, **arguments)
        grouped_grads = torch.autograd.grad(grouped.float().square().sum(), list(inputs.values()))
    except (RuntimeError, ValueError):
        return False
    repeated = varlen_attn(inputs["query"], inputs["key"].repeat_interleave(2, dim=1),
                           inputs["value"].repeat_interleave(2, dim=1), cu, cu, 4, 4, **arguments)
    repeated_grads = torch.autograd.grad(repeated.float().square().sum(), list(inputs.values()))
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
               for a, b in zip((grouped, *grouped_grads), (repeated, *repeated_grads)))


_VARLEN_PARAMETERS: frozenset[str] = frozenset()


def _varlen_parameters() -> frozenset[str]:
    """The keyword names this PyTorch's varlen_attn takes, read once into a module constant (a plain
    global, so torch.compile reads it instead of tracing `inspect.signature` in every layer)."""
    global _VARLEN_PARAMETERS
    if not _VARLEN_PARAMETERS:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMETERS


def _causal_arguments(scale: float | None, sliding_window: int | None, head_dim: int) -> dict:
    """Causal (and windowed) masking in the form this PyTorch's varlen_attn takes."""
    parameters = _varlen_parameters()
    arguments = {"scale": scale} if "scale" in parameters else {}
    if "scale" not in parameters and scale is not None and abs(scale - head_dim**-0.5) > 1e-9:
        raise NotImplementedError("this PyTorch's varlen attention takes no custom scale: set attn_implementation=sdpa")
    if "window_size" in parameters:
        arguments["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    else:
        if sliding_window:
            raise NotImplementedError("this PyTorch's varlen attention has no sliding window: "
                                      "set attn_implementation=sdpa")
        arguments["is_causal"] = True
    return arguments
