"""Which part of each weight a rank of a tensor-parallel replica holds (`ember/inference/tensor_parallel.py`),
by the weight's HF name, and cutting it out of the weight as it arrives.

- Column-parallel (a block of output rows): q/k/v projections, gate and up of every SwiGLU MLP
  (dense, shared expert, each routed expert by its per-expert name; the fused `experts.gate_up_proj`
  keeps a block of its gate half and the same block of its up half). With fewer key-value heads
  than ranks, k and v keep the one head the rank's query heads read.
- Row-parallel (a block of input columns): o and down projections (fused `experts.down_proj` too);
  their biases are added by the group's first rank only, so the all-reduce counts them once.
- Vocabulary rows: the embedding and the LM head, the vocabulary padded with zero rows to a
  multiple of the ranks (the padded logits are cut off after the all-gather, never sampled).
- Everything else (norms, the MoE router, the shared expert's gate) is whole on every rank.

The one thing to know: a weight may arrive whole (a checkpoint, the FSDP2 actor's gathered
buckets) or already as this rank's part (a trainer sharded like the engine): `own_part` tells
them apart by shape, and cuts only the whole. Biases of row-parallel layers are the same shape
either way and are always read as whole. Cutting takes views (copies only of this rank's part,
where the fused gate/up halves or the vocabulary padding need one), so a sync holds no more than
the bucket it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
_KEY_VALUE = (".self_attn.k_proj.", ".self_attn.v_proj.")
_OUTPUT_ROWS = (".self_attn.q_proj.", ".gate_proj.", ".up_proj.")
_INPUT_COLUMNS = (".o_proj.weight", ".down_proj.weight", ".experts.down_proj")
_ADDED_ONCE = (".o_proj.bias", ".down_proj.bias")
_FUSED_GATE_UP = ".experts.gate_up_proj"


def padded_vocab_size(vocab_size: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of `size` ranks."""
    return -(-vocab_size // size) * size


def vocab_rows(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of the padded vocabulary that `rank` of `size` holds: consecutive, equal in number."""
    rows = padded_vocab_size(vocab_size, size) // size
    return rank * rows, rows


@dataclass(frozen=True)
class WeightShards:
    """How one rank of `size` cuts the weights of one model: its `rank`, the model's key-value heads and vocabulary."""

    size: int
    rank: int
    kv_heads: int
    vocab_size: int

    def own_part(self, name: str, tensor: Tensor, local_shape: torch.Size) -> Tensor:
        """This rank's part of the weight `name` (whole, or already this rank's part) for a parameter of
        `local_shape`; the tensor itself where nothing is split."""
        if self.size == 1:
            return tensor
        if name.endswith(_ADDED_ONCE):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if tensor.shape == local_shape:  # nothing to cut: a whole weight kept whole, or this rank's part already
            return tensor
        if name in _VOCAB_ROWS:
            return self._vocabulary_rows(name, tensor, local_shape[0])
        if name.endswith(_FUSED_GATE_UP):
            half = local_shape[1] // 2
            return torch.cat([self._block(name, part, 1, half, self.size) for part in tensor.chunk(2, dim=1)], dim=1)
        if any(part in name for part in _KEY_VALUE):
            return self._block(name, tensor, 0, local_shape[0], min(self.kv_heads, self.size))
        if any(part in name for part in _OUTPUT_ROWS):
            return self._block(name, tensor, 0, local_shape[0], self.size)
        if name.endswith(_INPUT_COLUMNS):
            return self._block(name, tensor, -1, local_shape[-1], self.size)
        return tensor  # whole on every rank; a wrong shape is refused by the copy

    def _block(self, name: str, tensor: Tensor, dim: int, length: int, blocks: int) -> Tensor:
        """Block `rank · blocks / size` of `length` along `dim` of a whole tensor of `blocks` such blocks
        (blocks < size: neighbouring ranks share a block)."""
        if tensor.shape[dim] != length * blocks:
            raise ValueError(
                f"weight '{name}' has {tensor.shape[dim]} along dimension {dim}: ember's engine at tensor parallel "
                f"size {self.size} takes the whole weight ({length * blocks}) or this rank's part ({length})")
        return tensor.narrow(dim, self.rank * blocks // self.size * length, length)

    def _vocabulary_rows(self, name: str, tensor: Tensor, rows: int) -> Tensor:
        """This rank's `rows` vocabulary rows of a whole embedding or head; rows past the vocabulary are zeros."""
        if tensor.shape[0] not in (self.vocab_size, rows * self.size):
            raise ValueError(
                f"weight '{name}' has {tensor.shape[0]} rows: ember's engine at tensor parallel size {self.size} "
                f"takes the whole vocabulary ({self.vocab_size}, or {rows * self.size} padded) or this rank's "
                f"{rows} rows")
        start = self.rank * rows
        part = tensor[start : start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part
