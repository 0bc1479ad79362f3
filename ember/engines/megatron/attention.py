"""Core attention for megatron-core's local layer spec on PyTorch's fused SDPA kernels.

megatron-core's own `DotProductAttention` (the local spec's, used without Transformer
Engine) materialises the [b, heads, s, s] scores and softmax in fp32 and, for sizes its
fused-softmax CUDA extension would handle, imports that extension, which a plain pip install
does not have. This module takes its place in the layer spec: the same inputs ([s, b, heads,
head_dim] query, key and value; ember's boolean mask, True = masked), one
`scaled_dot_product_attention` call (grouped-query heads passed through), no [s, s] scores
kept for backward.

Packed rows (megatron-core's THD format, `model_inputs.py`): megatron-core hands the query, key and
value as [t, heads, head_dim] with `packed_seq_params` naming the sequences. Each sequence attends
causally to itself alone: on CUDA in bf16/fp16 through the flash varlen kernel the FSDP2 engine's packed
rows use (`engines/varlen_attention.py`, grouped-query heads as it passes them), elsewhere (a CPU, fp32)
one causal SDPA call per sequence, the reference the kernel is checked against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ember.engines.varlen_attention import varlen_attention_forward, varlen_available


def sdpa_core_attention_class():
    """The module class (built lazily: it subclasses megatron-core's MegatronModule)."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """Drop-in for megatron-core's DotProductAttention on torch SDPA; see the module docstring."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection=None):
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                from ember.errors import UserError

                raise UserError("megatron.context_parallel_size > 1 needs Transformer Engine's attention; install "
                                "transformer-engine or set context_parallel_size: 1")
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
            keep = None if attention_mask is None else ~attention_mask
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, is_causal=attention_mask is None,
                dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
                enable_gqa=q.shape[1] != k.shape[1])
            # [b, heads, s, dim] -> [s, b, heads * dim]
            batch, heads, length, dim = context.shape
            return context.permute(2, 0, 1, 3).reshape(length, batch, heads * dim)

        def _packed(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params) -> Tensor:
            """[t, heads, dim] packed queries, keys and values -> [t, heads * dim], each sequence of
            `packed_seq_params.cu_seqlens_q` attending causally to itself."""
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: ember's core attention "
                                 "takes megatron-core's 'thd' format only")
            dropout = self.dropout if self.training else 0.0
            cu_seqlens = packed_seq_params.cu_seqlens_q
            if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and varlen_available():
                # The kernel's layout: (1, heads, t, dim) in, (1, t, heads, dim) out.
                context, _ = varlen_attention_forward(
                    self, *(tensor.transpose(0, 1).unsqueeze(0) for tensor in (query, key, value)), None,
                    dropout=dropout, scaling=self.scale, cu_seq_lens_q=cu_seqlens,
                    max_length_q=packed_seq_params.max_seqlen_q)
                return context.reshape(query.shape[0], -1)
            bounds = cu_seqlens.tolist()
            contexts = []
            for start, end in zip(bounds, bounds[1:]):
                # [length, heads, dim] -> [1, heads, length, dim]
                q, k, v = (tensor[start:end].transpose(0, 1).unsqueeze(0) for tensor in (query, key, value))
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=dropout, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
                contexts.append(context[0].transpose(0, 1).reshape(end - start, -1))
            return torch.cat(contexts)

    return SDPACoreAttention
