"""Moving an FSDP2 model's shards and its optimizer state between the device and CPU memory.

In a colocated run, training, generation and the other roles take turns on the same
accelerators; what a role does not need in the current phase goes to CPU memory and comes
back before its next use. Only sharded state moves (each rank moves its 1/N), and moving
is only legal between steps: gradients must have been cleared (the engine zeroes them with
`set_to_none` after every optimizer step).

Offloaded tensors land in `HostCopies`: one pinned CPU buffer per tensor, made on the first
offload and rewritten on every later one. A copy from pageable memory is staged through a
driver buffer and waits for the device at every call; pinning is slow too (seconds for a
few gigabytes), so it happens once. Copies both ways are then asynchronous at the bus's
speed; offloading ends with one wait for them, so the CPU copies are complete when it returns.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ember.distributed.device import empty_cache, synchronize

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


def _moved(tensor: Tensor, device: torch.device, host: HostCopies | None, key: str | None) -> Tensor:
    """`tensor` on `device`: into `host`'s buffer for `key` when it goes to CPU through one, otherwise
    an asynchronous copy (the mover waits for the copies before it returns)."""
    if device == CPU and host is not None and key is not None:
        return host.store(key, tensor)
    return tensor.to(device, non_blocking=True)


def move_parameters(model: nn.Module, device: torch.device, buffers_stay_on: torch.device | None = None,
                    host: HostCopies | None = None) -> None:
    """Move the FSDP2 module's sharded parameters (and buffers) to `device`, to CPU through `host`'s
    buffers where given; with `buffers_stay_on`, the buffers (not sharded: RoPE tables) go there
    instead (FSDP2's offload policy computes with device buffers over CPU shards, which it pins
    when it first runs)."""
    names = {id(tensor): name for name, tensor in chain(model.named_parameters(), model.named_buffers())}
    # nn.Module._apply is what Module.to runs (FSDP2 re-points its shards after it as after .to)
    model._apply(lambda tensor: _moved(tensor, device, host, names.get(id(tensor))))
    if buffers_stay_on is not None:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(buffers_stay_on)
    if device == CPU:
        synchronize()  # the CPU copies are complete when offloading returns
        empty_cache()


def move_optimizer_state(optimizer: Optimizer, device: torch.device, host: HostCopies | None = None) -> None:
    """Move the optimizer's per-parameter state tensors (AdamW moments) to `device`, to CPU through
    `host`'s buffers where given.

    Scalars stay where the optimizer made them: AdamW keeps its step counts on the CPU
    unless it is capturable, and they are a few bytes.
    """
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if not (isinstance(value, Tensor) and value.dim() > 0):
                continue
            state[key] = _moved(value, device, host, f"optimizer.{index}.{key}")
    if device == CPU:
        synchronize()  # the CPU copies are complete when offloading returns
        empty_cache()
