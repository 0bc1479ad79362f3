"""Moving an FSDP2 model's shards and its optimizer state between the device and CPU memory.

In a colocated run, training, generation and the other roles take turns on the same
accelerators; what a role does not need in the current phase goes to CPU memory and comes
back before its next use. Only sharded state moves (each rank moves its 1/N), and moving
is only legal between steps: gradients must have been cleared (the engine zeroes them with
`set_to_none` after every optimizer step).

Offloaded tensors land in `HostCopies` (`engines/host_copies.py`, shared with the Megatron
engine's offload): one pinned CPU buffer per tensor, kept between offloads. Copies both ways
are asynchronous; offloading ends with one wait for them, so the CPU copies are complete
when it returns.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ember.distributed.device import empty_cache, synchronize
from ember.engines.host_copies import CPU, HostCopies


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
