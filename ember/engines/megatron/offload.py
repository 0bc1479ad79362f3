"""Moving a Megatron engine's parameters, gradients and optimizer state to CPU memory between phases.

megatron-core's DDP keeps a trained role's parameters and gradients in contiguous buffers
(`_ParamAndGradBuffer.param_data`, `grad_data`), and every parameter, its `main_grad`, the
DDP buckets and the distributed optimizer's shards are views into them. A view cannot be
re-pointed at a CPU copy, so nothing here replaces a tensor: a device storage is emptied
(`resize_(0)` frees its memory) once its bytes are in a pinned host copy, and refilled in
place (`resize_` back, bytes copied in) before the next use. Every view, whoever holds it,
then reads the same storage again.

The one move serves everything that goes: the parameters' storages (the DDP buffers, or
each parameter's own storage where there is no buffer: the reference, or a trained role
without the distributed optimizer), the optimizer's own tensors (fp32 master weights and
Adam's moments) and the gradient buffers, whose values are not kept: the engine zeroes
them before every update. Host copies are `engines/host_copies.py`'s `HostCopies`: pinned once,
rewritten on every later offload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ember.distributed.device import empty_cache, synchronize
from ember.engines.host_copies import HostCopies


@dataclass
class _EmptiedStorage:
    storage: torch.UntypedStorage
    nbytes: int
    host: Tensor | None
    """The storage's bytes in CPU memory; None for a gradient buffer (refilled with zeros)."""


class MegatronOffload:
    """Empties the device storages a role's options name into CPU memory (`offload`) and refills
    them in place (`onload`). Offloading twice in a row moves nothing the second time.

    `grads` and `optimizer` are for a trained role only: its chunks are megatron-core DDP modules
    and it has an optimizer.
    """

    def __init__(self, params: bool, grads: bool, optimizer: bool):
        self.params = params
        self.grads = grads
        self.optimizer = optimizer
        self.host = HostCopies()
        self._emptied: list[_EmptiedStorage] = []

    @torch.no_grad()
    def offload(self, chunks: list[nn.Module], optimizer) -> None:
        """Move what the options name for these model chunks and their megatron-core optimizer (None
        for the reference) to CPU memory; the host copies are complete when it returns."""
        parameters = _storages(param for chunk in chunks for param in chunk.parameters())
        kept: dict[str, dict[int, torch.UntypedStorage]] = {}
        if self.params:
            kept["params"] = parameters
        if self.optimizer:
            # in fp32 the optimizer steps the parameters themselves: those move with param_offload
            kept["optimizer"] = {address: storage for address, storage in _optimizer_storages(optimizer).items()
                                 if address not in parameters}
        zeroed = {}
        if self.grads:
            optimizer.zero_grad()  # the master weights' .grad (copies where grads are not fp32) is spent
            zeroed = _gradient_storages(chunks)
        emptied = [_EmptiedStorage(storage, storage.nbytes(), self.host.store(f"{kind}.{index}", _bytes(storage)))
                   for kind, storages in kept.items() for index, storage in enumerate(storages.values())]
        emptied += [_EmptiedStorage(storage, storage.nbytes(), None) for storage in zeroed.values()]
        if not emptied:
            return
        synchronize()  # the host copies are complete before their device storage is freed
        for item in emptied:
            item.storage.resize_(0)
        self._emptied += emptied
        empty_cache()

    @torch.no_grad()
    def onload(self) -> None:
        """Refill every emptied storage in place: its bytes from CPU memory, or zeros for gradients."""
        for item in self._emptied:
            item.storage.resize_(item.nbytes)
            if item.host is None:
                _bytes(item.storage).zero_()
            else:
                _bytes(item.storage).copy_(item.host, non_blocking=True)
        self._emptied = []


def _storages(tensors: Iterable[Tensor]) -> dict[int, torch.UntypedStorage]:
    """The distinct device storages under `tensors` that hold memory, by address, in first-seen order
    (a storage already emptied, or one in CPU memory, has nothing to move)."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.device.type != "cpu" and storage.nbytes() > 0:
            found.setdefault(storage.data_ptr(), storage)
    return found


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """All of `storage` as a flat uint8 tensor (a view: whatever parts of it other tensors view)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _gradient_storages(chunks: list[nn.Module]) -> dict[int, torch.UntypedStorage]:
    """The gradient buffers of megatron-core's DDP (each parameter's `main_grad` is a view into one)."""
    return _storages(buffer.grad_data for chunk in chunks
                     for buffer in chunk.buffers + chunk.expert_parallel_buffers)


def _optimizer_storages(optimizer) -> dict[int, torch.UntypedStorage]:
    """What the torch optimizers inside megatron-core's optimizer hold: the tensors they step (the
    fp32 master weights of bf16/fp16 parameters; the parameters themselves in fp32) and their
    per-parameter state (Adam's moments)."""
    from megatron.core.optimizer import ChainedOptimizer

    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    # a rank holding no parameter of a group has a stub part without a torch optimizer
    inner = [part.optimizer for part in parts if part.optimizer is not None]
    stepped = (param for torch_optimizer in inner for group in torch_optimizer.param_groups
               for param in group["params"])
    state = (value for torch_optimizer in inner for per_param in torch_optimizer.state.values()
             for value in per_param.values() if isinstance(value, Tensor))
    return _storages([*stepped, *state])
