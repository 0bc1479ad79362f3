"""Rotary embedding of a packed (THD) row in one pass over its tokens, for megatron-core's local layer spec.

megatron-core rotates a packed row without Transformer Engine (`rope_utils._apply_rotary_pos_emb_thd`)
one sequence at a time: a Python loop over the row's sequences for the query and the key of every
layer, forward and backward. A token-budget micro-batch holds hundreds of short sequences, so the
loop's small kernels and host work, not the model, set the step's pace (on an H200, Qwen2.5-0.5B's
shape, 512 sequences of 384 tokens: 14.8k tokens/s packed against 105.7k padded). `install` puts
`packed_rotary_pos_emb` in front of megatron-core's function where its attention calls it: each token
of a packed row gets the table entry of its own position (positions restart at every sequence
start in `cu_seqlens`) and the whole row is rotated as one sequence by megatron-core's own
unpacked code, which computes the same numbers. Everything else (no `cu_seqlens`, context
parallelism) goes to megatron-core's function unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

_original = None  # megatron-core's apply_rotary_pos_emb, once `install` has run


def positions_in_sequences(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """Each token's position within its own sequence, from the cumulative lengths (no host sync)."""
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    first_token = torch.repeat_interleave(starts, lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - first_token


def packed_rotary_pos_emb(t: Tensor, freqs: Tensor, config, cu_seqlens: Tensor | None = None, mscale: float = 1.0,
                          cp_group=None, **kwargs) -> Tensor:
    """megatron-core's `apply_rotary_pos_emb` with a packed row [T, heads, dim] rotated in one pass."""
    if cu_seqlens is None or (cp_group is not None and cp_group.size() > 1):
        return _original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)
    per_token = freqs[positions_in_sequences(cu_seqlens, t.shape[0])]  # [T, 1, 1, dim]
    rotated = _original(t.unsqueeze(1), per_token, config, cu_seqlens=None, mscale=mscale, cp_group=cp_group, **kwargs)
    return rotated.squeeze(1)


def install() -> None:
    """Route megatron-core's attention through `packed_rotary_pos_emb` (idempotent)."""
    global _original
    from megatron.core.transformer import attention

    if _original is None:
        _original = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = packed_rotary_pos_emb
