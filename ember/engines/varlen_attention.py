"""Variable-length attention for packed micro-batches: "ember_varlen", a transformers attention function.

A packed micro-batch (`ember/data/packing.py`) is one row of many sequences. transformers'
own sdpa path keeps attention inside each sequence with an explicit block-diagonal mask,
which rules out the flash kernel and builds a [T, T] mask. "ember_varlen" instead calls
PyTorch's flash-attention varlen kernel (`torch.nn.attention.varlen`) with the packed
batch's cumulative sequence lengths, which `compute_response_log_probs` and
`compute_response_values` pass as `cu_seq_lens_q` / `max_length_q` (transformers hands
such keyword arguments down to every attention call). A call without them that has an
attention mask (a padded forward, or `generate` on the same module) runs transformers'
sdpa with that mask; a packed row without them is refused, since nothing would keep its
sequences apart. Options the kernel cannot honour (attention dropout, logit softcapping,
attention sinks) are refused rather than ignored. The kernel call itself (and how grouped-query
heads reach it) is `ember/flash_varlen.py`, shared with the generation engine's prefill.

`packed_attention_implementation` picks it for CUDA engines that pack, where the kernel exists.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ember import flash_varlen
from ember.flash_varlen import causal_varlen_attention, varlen_available

NAME = "ember_varlen"


def packed_attention_implementation(configured: str, use_remove_padding: bool, device: torch.device,
                                    compute_dtype: torch.dtype) -> str:
    """The attention implementation an engine loads its model with: "ember_varlen" for packed sdpa on CUDA
    in a half-precision compute dtype (the flash kernel has no float32)."""
    half = compute_dtype in (torch.bfloat16, torch.float16)
    if use_remove_padding and configured == "sdpa" and half and device.type == "cuda" and varlen_available():
        register()
        return NAME
    return configured


def register() -> None:
    """Make "ember_varlen" known to transformers (attention function and mask builder); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    flash_varlen.prepare()  # resolved here, before any compiled layer calls the attention
    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask_for_padded_inputs)


def _mask_for_padded_inputs(*args, attention_mask: Tensor | None = None, **kwargs):
    """sdpa's mask where the input has padding; none for packed rows (the varlen kernel needs no mask)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """(1, heads, T, dim) packed queries/keys/values → (1, T, heads, dim), each sequence attending causally to itself."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None and query.shape[0] == 1 and _restarts(kwargs.get("position_ids")):
            raise ValueError("a packed row reached ember_varlen attention without cu_seq_lens_q / max_length_q: "
                             "pass the packed batch's attention_kwargs() to the model call")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    unsupported = {"dropout": dropout > 0 and module.training, "softcap": kwargs.get("softcap"),
                   "s_aux": kwargs.get("s_aux") is not None}
    if any(unsupported.values()):
        raise NotImplementedError(
            f"ember_varlen attention cannot apply {', '.join(k for k, v in unsupported.items() if v)}: "
            "set attn_implementation=sdpa (or flash_attention_2 where installed) for this model")
    queries, keys, values = (states[0].transpose(0, 1) for states in (query, key, value))  # (T, heads, dim)
    cu = cu_seq_lens_q.to(device=queries.device, dtype=torch.int32)
    output = causal_varlen_attention(queries, keys, values, cu, max_length_q, scaling, sliding_window)
    return output.unsqueeze(0), None


def _restarts(position_ids: Tensor | None) -> bool:
    """Whether a [1, T] row of position ids starts over somewhere (several sequences packed)."""
    return position_ids is not None and bool((position_ids[0, 1:] == 0).any())
