"""Tensor parallelism inside ember's generation engine: one model replica split over a group of ranks.

Attention is split by heads (each rank its share of the query and key-value heads, and of the KV
cache; with fewer key-value heads than ranks, each key-value head is held by the ranks whose query
heads read it), every SwiGLU MLP (dense, each routed expert, the shared expert) by its intermediate
width (gate and up by rows, down by columns), and the embedding and LM head by vocabulary rows. Each
block's output projection leaves a partial sum (in fp32: `layers.PartialSumLinear`) that one all-reduce
completes in fp32, rounded to bf16 once as the unsplit product is, so every rank of the group ends each
block with the same hidden states; the embedding is a masked lookup completed by an
all-reduce, and the LM head's logits are all-gathered over the vocabulary, so every rank samples the
same tokens from the same whole logits with the batch-invariant sampler. The ranks' schedulers then
take the same decisions and need no messages besides these collectives (and one agreement on the
KV-cache size). Which part of each weight a rank holds is `models/weight_shards.py`.

A group is `size` consecutive ranks of the current process group; `replica_group` makes every
replica's group (a collective call: every rank of the pool calls it, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ember.errors import UserError

SIZE_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its replica: `size` ranks, this one `rank` among them, their `group`."""

    size: int = 1
    rank: int = 0
    group: object | None = None

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """The sum of `tensor` over the group, in place (nothing at size 1)."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def sum_partials(self, partial: Tensor) -> Tensor:
        """A block's output from this rank's partial sum of it: summed over the group in float32 (`partial` itself
        at size 1). It is rounded to the activations' dtype once, where it joins the residual stream
        (`layers.add_rms_norm`: one kernel with the add and the norm, no separate cast)."""
        if self.size == 1:
            return partial
        summed = partial.float()
        dist.all_reduce(summed, group=self.group)
        return summed

    def all_gather_last_dim(self, tensor: Tensor) -> Tensor:
        """Every rank's `tensor` side by side along the last dimension, in rank order (`tensor` at size 1)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree_on_minimum(self, value: int, device: torch.device) -> int:
        """The smallest `value` any rank of the group has (the KV-cache blocks every rank can hold)."""
        if self.size == 1:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.group)
        return int(held.item())

    def check_divides(self, heads: int, kv_heads: int, widths: dict[str, int]) -> None:
        """Refuse a model this many ranks cannot split evenly, naming the key to change. `widths`: each
        split MLP width by what it is ("MLP width", "expert MLP width", ...)."""
        if self.size == 1:
            return
        counts = {"attention heads": heads, **widths}
        for what, count in counts.items():
            if count % self.size:
                raise UserError(f"{SIZE_KEY}={self.size} does not divide the model's {count} {what}; "
                                "choose a size that does")
        if kv_heads % self.size and self.size % kv_heads:
            raise UserError(f"{SIZE_KEY}={self.size}: the model's {kv_heads} key-value heads can neither be split "
                            "over the ranks nor each held by a whole number of them; choose a size that divides "
                            "or is a multiple of it")

    def local_kv_heads(self, kv_heads: int) -> int:
        """Key-value heads one rank holds: its share, or one head shared with other ranks when there are fewer."""
        return max(kv_heads // self.size, 1)


def replica_group(size: int) -> TensorParallel:
    """This rank's tensor-parallel group: ranks [k·size, (k+1)·size) of the current process group form
    replica k. Every rank must call it (creating groups is collective)."""
    if size == 1:
        return TensorParallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise UserError(f"{SIZE_KEY}={size} does not divide the {world} ranks that generate; choose a size that does")
    own = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            own = group
    return TensorParallel(size=size, rank=rank % size, group=own)
