"""Padding-free packing (`use_remove_padding`): a micro-batch's real tokens as one row.

A padded micro-batch [b, P+R] spends compute on every padding position; packed, only the
tokens with `attention_mask == 1` remain, laid end to end in one row [1, T], each sequence
keeping its own position ids (which start at 0 per sequence, as `Batch` counts them over
real tokens only).

The one thing to know: attention never crosses a sequence boundary because the model is
called with `attention_mask=None` and these position ids. Transformers then finds the
sequences where a position id does not follow its neighbour by one
(`masking_utils.find_packed_sequence_indices`) and builds a causal mask that is also
block-diagonal per sequence (eager, sdpa, flex attention); flash-attention takes the
variable-length path from the same position ids. A sequence always starts at position 0,
so it is never mistaken for the continuation of the one before it.

`PackedBatch.unpack` brings per-token outputs (log-probs, entropy, values) of the positions
that predict response tokens back to the [b, R] response layout of `Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.data.batch import Batch


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch without padding, and the way back to its response layout."""

    input_ids: Tensor
    """[1, T] the real tokens of every sample, sample after sample, prompt then response."""
    position_ids: Tensor
    """[1, T] each token's position within its own sequence (restarts at 0 per sample)."""
    cu_seqlens: Tensor
    """[b + 1] int32: sample i occupies packed positions cu_seqlens[i] .. cu_seqlens[i+1]-1."""
    prediction_index: Tensor
    """[N] packed positions whose outputs predict a response token (one per real response token)."""
    targets: Tensor
    """[N] the response token that each of those positions predicts."""
    response_slots: Tensor
    """[b, R] bool: where the N predictions belong in response layout, in row-major order."""
    max_length: int
    """Tokens of the longest sample."""

    def attention_kwargs(self) -> dict:
        """The sequence boundaries as transformers' variable-length attention keywords (cu_seq_lens_q, ...)."""
        return dict(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                    max_length_q=self.max_length, max_length_k=self.max_length)

    def unpack(self, values: Tensor) -> Tensor:
        """[N] (or [1, N]) per-prediction values → [b, R], zero where no response token is predicted.

        Differentiable: gradients flow back to the packed values.
        """
        values = values.reshape(-1)
        return values.new_zeros(self.response_slots.shape).masked_scatter(self.response_slots, values)


def pack_batch(batch: Batch) -> PackedBatch:
    """Pack `batch`'s tokens with `attention_mask == 1` into one row (see the module docstring).

    A response token gets a prediction when both it and the position before it (the last
    prompt token, or the previous response token) are real tokens.
    """
    mask = batch.attention_mask.bool()
    flat_mask = mask.reshape(-1)
    kept = flat_mask.nonzero().squeeze(1)
    lengths = mask.sum(dim=1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(dim=0, dtype=torch.int32), (1, 0))
    # The packed position of every kept padded position (meaningless at padding, never read there).
    packed_position = (flat_mask.cumsum(dim=0) - 1).view(mask.shape)
    predicting = batch.response_prediction_positions
    response_slots = mask[:, predicting] & mask[:, batch.prompt_length:]
    return PackedBatch(
        input_ids=batch.input_ids.reshape(-1)[kept].unsqueeze(0),
        position_ids=batch.position_ids.reshape(-1)[kept].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        prediction_index=packed_position[:, predicting][response_slots],
        targets=batch.responses[response_slots],
        response_slots=response_slots,
        max_length=int(lengths.max()),
    )
