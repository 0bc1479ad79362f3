"""Tensor parallelism inside ember's generation engine: one model replica split over a group of ranks.

Attention is split by heads (each rank its share of the query and key-value heads, and of the KV
cache), the dense MLP by its intermediate width (gate and up by rows, down by columns); each block's
output projection leaves a partial sum that one all-reduce completes, so every rank of the group
ends each block with the same hidden states. Embedding, norms and the LM head stay whole on every
rank: every rank computes the same logits and draws the same tokens with the batch-invariant
sampler, so the ranks' schedulers take the same decisions and need no messages besides the
all-reduces (and one agreement on the KV-cache size). The weights arrive whole, under their HF
names (the training engine's sync or a checkpoint), and `shard` cuts each rank's part.

A group is `size` consecutive ranks of the current process group; `replica_group` makes every
replica's group (a collective call: every rank of the pool calls it, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ember.errors import UserError

_BY_ROWS = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", ".mlp.gate_proj.", ".mlp.up_proj.")
"""Weights and biases whose output features are split (column-parallel layers)."""
_BY_COLUMNS = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")
"""Weights whose input features are split (row-parallel layers: a partial sum each)."""
_ONCE = (".self_attn.o_proj.bias", ".mlp.down_proj.bias")
"""Biases of row-parallel layers: added by the group's first rank only, so the all-reduce counts them once."""


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

    def agree_on_minimum(self, value: int, device: torch.device) -> int:
        """The smallest `value` any rank of the group has (the KV-cache blocks every rank can hold)."""
        if self.size == 1:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.group)
        return int(held.item())

    def shard(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the whole weight `name` (the whole tensor where nothing is split)."""
        if self.size == 1:
            return tensor
        if any(part in name for part in _BY_ROWS):
            return tensor.chunk(self.size, dim=0)[self.rank]
        if name.endswith(_BY_COLUMNS):
            return tensor.chunk(self.size, dim=1)[self.rank]
        if name.endswith(_ONCE):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor

    def check_divides(self, heads: int, kv_heads: int, intermediate: int, sparse: bool) -> None:
        """Refuse a model this many ranks cannot split evenly, naming the key to change."""
        key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
        if sparse:
            raise UserError(f"{key}={self.size}: ember's engine splits dense models only (not mixture-of-experts "
                            "layers yet); use 1 for this model")
        for count, what in ((heads, "attention heads"), (kv_heads, "key-value heads"), (intermediate, "MLP width")):
            if count % self.size:
                raise UserError(f"{key}={self.size} does not divide the model's {count} {what}; choose a size that does")


def replica_group(size: int) -> TensorParallel:
    """This rank's tensor-parallel group: ranks [k·size, (k+1)·size) of the current process group form
    replica k. Every rank must call it (creating groups is collective)."""
    if size == 1:
        return TensorParallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise UserError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the {world} "
                        "ranks that generate; choose a size that does")
    own = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            own = group
    return TensorParallel(size=size, rank=rank % size, group=own)
