"""Pinned CPU buffers for offloaded tensors, shared by the FSDP2 and Megatron engines' offload.

One pinned buffer per tensor, made on the first offload and rewritten on every later one. A copy
from pageable memory is staged through a driver buffer and waits for the device at every call;
pinning is slow too (seconds for a few gigabytes), so it happens once. Copies both ways are then
asynchronous at the bus's speed; the caller waits for them once (`device.synchronize`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

CPU = torch.device("cpu")


class HostCopies:
    """Pinned CPU buffers that offloaded tensors are copied into, one per key, kept between offloads
    (plain CPU copies where CUDA is absent: there is no pinned memory to use)."""

    def __init__(self) -> None:
        self.pinned = torch.cuda.is_available()
        self._buffers: dict[str, Tensor] = {}

    def store(self, key: str, tensor: Tensor) -> Tensor:
        """A CPU tensor holding `tensor`'s values (a DTensor with the same layout for a DTensor), in the
        buffer kept for `key`; the copy may still be running until `synchronize()`."""
        if not self.pinned or tensor.device.type == "cpu":
            return tensor.to(CPU)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = self._buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
        buffer.copy_(local, non_blocking=True)
        if isinstance(tensor, DTensor):
            # DTensor's own constructor, as its CPU copies get it: from_local would move the buffer
            # back to the mesh's device type.
            return DTensor(buffer, tensor._spec, requires_grad=False)
        return buffer
