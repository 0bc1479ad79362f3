"""Copying full, named weights into a model's own tensors in place: the one routine behind
every `update_weights` (the transformers rollout's own copy, ember's generation engine).

Names are the model's (Hugging Face checkpoint names); a name the model lacks or a tensor of
another shape is an error that says what to send instead. The copies of one call are one
`torch._foreach_copy_` per pair of devices (casting where dtypes differ): a small model's
weight sync is hundreds of tensors, and a launch each sets its pace. Sources wait for their
copy up to PENDING_BYTES in all, so a checkpoint read one tensor at a time is never held whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

PENDING_BYTES = 256 << 20
"""Source bytes held back for one batched copy at most (then copied, and the next batch starts)."""


def copy_named_tensors(targets: dict[str, Tensor], named_tensors: Iterable[tuple[str, Tensor]],
                       owner: str) -> set[str]:
    """Copies each (name, tensor) into `targets[name]`; returns the names written.

    `owner` names the receiving model in error messages.
    """
    written: set[str] = set()
    by_devices: dict[tuple[torch.device, torch.device], tuple[list[Tensor], list[Tensor]]] = {}
    pending = 0
    for name, tensor in named_tensors:
        if name not in targets:
            raise KeyError(f"weight '{name}' has no place in {owner}; send the model's own (Hugging Face) "
                           f"parameter names, such as '{next(iter(targets))}'")
        target = targets[name]
        if target.shape != tensor.shape:
            raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)}, {owner} has "
                             f"{tuple(target.shape)}: send full (unsharded) tensors of the same model")
        destinations, sources = by_devices.setdefault((target.device, tensor.device), ([], []))
        destinations.append(target)
        sources.append(tensor)
        written.add(name)
        pending += tensor.nbytes
        if pending >= PENDING_BYTES:
            _copy_all(by_devices)
            pending = 0
    _copy_all(by_devices)
    return written


def _copy_all(by_devices: dict[tuple[torch.device, torch.device], tuple[list[Tensor], list[Tensor]]]) -> None:
    """One foreach copy per group on one device, a copy per tensor across devices; empties the groups."""
    with torch.no_grad():
        for (destination_device, source_device), (destinations, sources) in by_devices.items():
            if destination_device == source_device:
                torch._foreach_copy_(destinations, sources)
            else:
                for destination, source in zip(destinations, sources):
                    destination.copy_(source)
    by_devices.clear()
