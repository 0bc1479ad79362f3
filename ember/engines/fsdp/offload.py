"""Moving an FSDP2 model's shards and its optimizer state between the device and CPU memory.

In a colocated run, training, generation and the other roles take turns on the same
accelerators; what a role does not need in the current phase goes to CPU memory and comes
back before its next use. Only sharded state moves (each rank moves its 1/N), and moving
is only legal between steps: gradients must have been cleared (the engine zeroes them with
`set_to_none` after every optimizer step).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from ember.distributed.device import empty_cache

CPU = torch.device("cpu")


def move_parameters(model: nn.Module, device: torch.device, buffers_stay_on: torch.device | None = None) -> None:
    """Move the FSDP2 module's sharded parameters (and buffers) to `device`; with `buffers_stay_on`,
    the buffers (not sharded: RoPE tables) go there instead (FSDP2's offload policy computes with
    device buffers over CPU shards, which it pins when it first runs)."""
    model.to(device)
    if buffers_stay_on is not None:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(buffers_stay_on)
    if device == CPU:
        empty_cache()


def move_optimizer_state(optimizer: Optimizer, device: torch.device) -> None:
    """Move the optimizer's per-parameter state tensors (AdamW moments) to `device`.

    Scalars stay where the optimizer made them: AdamW keeps its step counts on the CPU
    unless it is capturable, and they are a few bytes.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
    if device == CPU:
        empty_cache()
