"""What megatron-core's GPTModel is called with for one micro-batch, and where its outputs predict responses.

Padded (the default): the micro-batch as it is, [b, s], with ember's boolean mask (causal, and no real
token attends padding), so left-padded prompts compute what an unpadded forward computes.

Packed (`use_remove_padding`): the real tokens of every sample in one row [1, T] (`data/packing.py`'s
PackedBatch: position ids restarting per sequence), no mask, and the sequence boundaries as megatron-core's
THD format, `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`. Two pieces of
megatron-core read them: its rotary embedding builds tables for `max_seqlen` positions and, with
`cu_seqlens`, rotates each sequence from position 0 (without Transformer Engine through
`packed_rope.py`, in one pass over the row); the core attention keeps each sequence to itself (ember's
`attention.py`, or Transformer Engine's). Under sequence parallelism the row is padded at its end to a multiple of the
tensor-parallel size (each rank holds an equal slice); the padding is one more sequence in `cu_seqlens`,
so it attends and rotates apart from the real ones, and no output reads it.

Either way the model's output is read through `prediction_positions` (the rows along its sequence that
predict the response tokens) and `to_response_layout` (those rows back to the micro-batch's [b, R]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.data.batch import Batch
from ember.data.packing import PackedBatch, pack_batch
from ember.engines.micro_batches import pad_prompt_columns


@dataclass(frozen=True)
class ModelInputs:
    """One micro-batch as the model takes it, and the way from the model's outputs to response layout."""

    micro: Batch
    """The micro-batch in ember's padded layout (what the loss function reads)."""
    arguments: dict
    """Keyword arguments of the GPTModel call: input_ids, position_ids, attention_mask (and packed_seq_params)."""
    prediction_positions: slice | Tensor
    """Along the model's sequence dimension: the outputs that predict response tokens (R of them padded, N packed)."""
    targets: Tensor
    """[b, R] padded or [1, N] packed: the response token each of those outputs predicts."""
    packing: PackedBatch | None = None
    """The packed row's way back to [b, R]; None when padded."""

    @property
    def packed_length(self) -> int | None:
        """Tokens of the packed row, its end padding included; None when padded."""
        return None if self.packing is None else self.arguments["input_ids"].shape[1]

    def to_response_layout(self, values: Tensor) -> Tensor:
        """Per-prediction values ([b, R] padded, [1, N] packed) as [b, R], zero where nothing is predicted."""
        return values if self.packing is None else self.packing.unpack(values)


def model_inputs(micro: Batch, packed: bool, multiple: int = 1) -> ModelInputs:
    """`micro` (on the model's device) padded or packed (see the module docstring); its sequence is made a
    multiple of `multiple` tokens (sequence parallelism: the tensor-parallel size; else 1)."""
    if not packed:
        micro = pad_prompt_columns(micro, multiple)
        arguments = dict(input_ids=micro.input_ids, position_ids=micro.position_ids,
                         attention_mask=padded_attention_mask(micro.attention_mask))
        return ModelInputs(micro, arguments, micro.response_prediction_positions, micro.responses)
    from megatron.core.packed_seq_params import PackedSeqParams

    packing = pack_batch(micro)
    input_ids, position_ids, cu_seqlens = packing.input_ids, packing.position_ids, packing.cu_seqlens
    extra = -input_ids.shape[1] % multiple
    if extra:
        input_ids, position_ids = (torch.nn.functional.pad(row, (0, extra)) for row in (input_ids, position_ids))
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + extra])
    longest = max(packing.max_length, extra)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    arguments = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None, packed_seq_params=params)
    return ModelInputs(micro, arguments, packing.prediction_index, packing.targets.unsqueeze(0), packing)


def padded_attention_mask(attention_mask: Tensor) -> Tensor:
    """megatron-core's [b, 1, s, s] boolean mask (True = masked): causal, and no padding key.

    Every position also sees itself, so that a padding query (before a left-padded prompt)
    has one key: a row with none would be NaN in fused attention, and its NaN gradient would
    reach every key in backward. Real tokens see themselves anyway.
    """
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    allowed = causal.unsqueeze(0) & (attention_mask.bool().unsqueeze(1) | itself)
    return ~allowed.unsqueeze(1)
