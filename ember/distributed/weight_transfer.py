"""Weights from the trainer's pool to a rollout pool in other processes (`hybrid_engine=false`).

A process group of its own joins the actor's first rank (group rank 0, the source) and every
rollout rank; the pools' default groups stay as they are. The one thing to know: the source
sends the buckets the actor's engine streams (`named_parameters_for_sync`: each bucket gathered
over the actor's ranks, cast to the compute dtype, then dropped), so no rank ever holds the whole
model at once beyond the engines' own weights. Each bucket goes as a header (its tensor count, the
weights' policy version and which list of tensors the sync sends) and then one broadcast per dtype
of its tensors packed in one flat buffer; a header of count 0 ends a sync. Names and shapes travel
once, before the first sync, as two lists (`SyncSpecs`: every weight, and only those training
changes, which with LoRA are the adapted layers), so a sync moves tensors only.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ember.distributed.device import current_device, separate_group

STORE_PREFIX = "ember-weights"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a sync, as the receivers allocate it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype's name, e.g. "bfloat16" (plain data for Ray)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class SyncSpecs:
    """The two tensor lists a sync may send, each in order: every weight (the first sync), and only the
    weights training changes (later syncs; with LoRA the adapted layers, merged)."""

    every: list[TensorSpec]
    trained: list[TensorSpec]

    def of(self, trained_only: bool) -> list[TensorSpec]:
        return self.trained if trained_only else self.every


def rendezvous_address() -> tuple[str, int]:
    """This node's address (as Ray sees it) and a free port, for a group's store hosted here."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        return ray.util.get_node_ip_address(), probe.getsockname()[1]


class WeightTransfer:
    """This process's end of the weight group: group rank 0 sends, the others receive."""

    def __init__(self, address: str, port: int, group_rank: int, group_size: int, timeout_s: float):
        from datetime import timedelta

        store = dist.TCPStore(address, port, group_size, is_master=group_rank == 0,
                              timeout=timedelta(seconds=timeout_s))
        self.group = separate_group(dist.PrefixStore(STORE_PREFIX, store), group_rank, group_size, timeout_s)
        self._store = store  # the group reads from it for as long as it lives
        self.group_rank = group_rank
        self.device = current_device()

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], specs: SyncSpecs, version: int,
             trained_only: bool) -> dict:
        """Broadcasts every bucket (each checked against `specs.of(trained_only)`, in order) and the end header;
        bytes and seconds."""
        start, sent, position = time.perf_counter(), 0, 0
        listed, sent_specs = int(trained_only), specs.of(trained_only)
        for bucket in buckets:
            expected = sent_specs[position:position + len(bucket)]
            found = [TensorSpec.of(name, tensor) for name, tensor in bucket]
            if found != expected:
                raise RuntimeError(f"the actor's weights changed layout since the rollout was told them: "
                                   f"{found[:2]}... against {expected[:2]}...")
            position += len(bucket)
            self._header(len(bucket), version, listed)
            for flat in _flat_by_dtype([tensor for _, tensor in bucket]):
                self._broadcast(flat)
                sent += flat.numel() * flat.element_size()
        if position != len(sent_specs):
            raise RuntimeError(f"the actor sent {position} tensors, the rollout expects {len(sent_specs)}")
        self._header(0, version, listed)
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    def receive(self, specs: SyncSpecs, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Receives buckets until the end header, handing each to `load` (named full tensors, views of the
        received buffers, from the list each header names); the version sent."""
        position = 0
        while True:
            count, version, trained_only = self._header()
            if count == 0:
                return version
            bucket_specs = specs.of(bool(trained_only))[position:position + count]
            position += count
            tensors: dict[int, torch.Tensor] = {}
            for dtype, indices in _by_dtype([spec.torch_dtype for spec in bucket_specs]).items():
                sizes = [math.prod(bucket_specs[index].shape) for index in indices]
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
                self._broadcast(flat)
                for index, piece in zip(indices, flat.split(sizes)):
                    tensors[index] = piece.view(bucket_specs[index].shape)
            load([(spec.name, tensors[index]) for index, spec in enumerate(bucket_specs)])

    def _header(self, count: int = 0, version: int = 0, trained_only: int = 0) -> tuple[int, int, int]:
        header = torch.tensor([count, version, trained_only], dtype=torch.int64, device=self.device)
        self._broadcast(header)
        return int(header[0]), int(header[1]), int(header[2])

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()


def _by_dtype(dtypes: list[torch.dtype]) -> dict[torch.dtype, list[int]]:
    """The positions of each dtype, dtypes in order of first appearance (the order both ends send them in)."""
    positions: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        positions.setdefault(dtype, []).append(index)
    return positions


def _flat_by_dtype(tensors: list[torch.Tensor]):
    """One flat buffer per dtype holding those tensors' values (one foreach copy each), in `_by_dtype`'s order."""
    for dtype, indices in _by_dtype([tensor.dtype for tensor in tensors]).items():
        group = [tensors[index] for index in indices]
        flat = torch.empty(sum(tensor.numel() for tensor in group), dtype=dtype, device=group[0].device)
        with torch.no_grad():
            torch._foreach_copy_([piece.view(tensor.shape) for piece, tensor in
                                  zip(flat.split([tensor.numel() for tensor in group]), group)], group)
        yield flat
