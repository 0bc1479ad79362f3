"""Whole weights out of FSDP2's shards for a weight sync: one all-gather per bucket, in the compute dtype.

Gathering parameter by parameter (DTensor's `full_tensor`) is one collective and some host
time per parameter, in the stored dtype (fp32 masters): at several ranks that set the pace of
a small model's sync to the rollout engine (125–205 ms a step for a 0.5B on 2–4 H100s,
BENCHMARKS.md). Here a bucket of parameters travels as one flat buffer: each rank casts its
shards into its part of the buffer (one foreach copy), one `all_gather_into_tensor` gives
every rank every part, and each parameter's whole tensor is cut out of the gathered rows.
FSDP2 shards dimension 0 as `torch.chunk` does, so rank r holds rows [r·c, (r+1)·c) of a
parameter with c = ceil(rows / ranks), fewer (or none) on the last ranks; each rank's part
reserves c rows per parameter, and the rows a rank does not hold are cut off after the gather.
A parameter sharded otherwise (not one `Shard(0)` over one mesh dimension) is gathered alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from ember.engines.batching import in_buckets


def gathered_buckets(named: Iterable[tuple[str, DTensor]], bucket_bytes: int, dtype: torch.dtype,
                     device: torch.device) -> Iterator[list[tuple[str, Tensor]]]:
    """The whole tensors of `named` (sharded parameters) in `dtype` on `device`, in buckets of about
    `bucket_bytes` of the stored tensors; every rank of the parameters' mesh must consume every bucket."""
    for bucket in in_buckets(named, bucket_bytes):
        flat = [(name, tensor) for name, tensor in bucket if _row_sharded(tensor)]
        gathered = dict(_gather_rows(flat, dtype, device)) if flat else {}
        yield [(name, gathered[name] if name in gathered else _gather_alone(tensor, dtype, device))
               for name, tensor in bucket]


def _row_sharded(tensor: Tensor) -> bool:
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.dim() > 0
            and tensor.shape[0] > 0 and tuple(tensor.placements) == (Shard(0),))


def _gather_alone(tensor: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    whole = tensor.to(device).full_tensor() if isinstance(tensor, DTensor) else tensor.to(device)
    return whole.to(dtype)


def _gather_rows(bucket: list[tuple[str, DTensor]], dtype: torch.dtype,
                 device: torch.device) -> list[tuple[str, Tensor]]:
    group = bucket[0][1].device_mesh.get_group()
    ranks = dist.get_world_size(group)
    layout = []  # (name, whole shape, offset of the parameter in a rank's part, elements reserved per rank)
    offset = 0
    for name, tensor in bucket:
        rows = tensor.shape[0]
        reserved = math.ceil(rows / ranks) * (tensor.numel() // rows if rows else 0)
        layout.append((name, tensor.shape, offset, reserved))
        offset += reserved
    part = torch.empty(offset, dtype=dtype, device=device)
    locals_ = [tensor.to_local() for _, tensor in bucket]
    with torch.no_grad():
        torch._foreach_copy_([part[start:start + local.numel()].view(local.shape)
                              for (_, _, start, _), local in zip(layout, locals_)],
                             [local.to(device) for local in locals_])
    everything = torch.empty(ranks * offset, dtype=dtype, device=device)
    dist.all_gather_into_tensor(everything, part, group=group)
    by_rank = everything.view(ranks, offset)
    return [(name, by_rank[:, start:start + reserved].reshape(-1, *shape[1:])[:shape[0]])
            for name, shape, start, reserved in layout]
