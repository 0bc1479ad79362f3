"""Stand-ins that let megatron-core's training path run on a CPU, for test worker processes only.

megatron-core's DDP, distributed optimizer and checkpoint writer allocate with `device="cuda"`,
read the current CUDA stream and synchronise the device; none of that changes a number. After
`stand_in_cuda()` those calls go to the CPU (and CUDA reports itself available, so ember's engine
builds its trained roles), while every computation, buffer layout, gradient reduction, optimizer
step and checkpoint byte is megatron-core's own. Call it first thing in a worker process: it
patches torch for the whole process.
"""

from __future__ import annotations

import contextlib

import torch

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "zeros_like", "empty_like", "ones_like")


class _Stream:
    """The current stream, as megatron-core's gradient buffers wait on it: nothing to wait for on a CPU."""

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def _on_cpu(factory):
    def wrapped(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return wrapped


def stand_in_cuda() -> None:
    """Patch this process's torch as the module docstring says."""
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    tensor_to, tensor_type = torch.Tensor.to, torch.Tensor.type

    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(arg) and isinstance(arg, (str, torch.device)) else arg for arg in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return tensor_to(self, *args, **kwargs)

    def type_name(self, *args, **kwargs):  # megatron-core's optimizers accept only torch.cuda.* parameter types
        result = tensor_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(result, str) or "cuda" in result:
            return result
        return result.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.to = to
    torch.Tensor.type = type_name
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
