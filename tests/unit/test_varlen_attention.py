"""The "ember_varlen" attention function's guards and its fallback, on CPU (the varlen kernel itself is a GPU test)."""

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ember.engines.varlen_attention import varlen_attention_forward


def states(tokens: int = 6, heads: int = 2, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, tokens, dim, generator=generator) for _ in range(3)]


def test_a_padded_call_with_a_mask_is_sdpa_with_that_mask():
    module = nn.Module().eval()
    module.is_causal = True
    query, key, value = states()
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[..., :2] = False  # two padding positions
    mask[..., 0, 0] = mask[..., 1, 1] = True
    ours, _ = varlen_attention_forward(module, query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(ours, expected)


def test_a_packed_row_without_sequence_boundaries_is_refused():
    module = nn.Module().eval()
    module.is_causal = True
    query, key, value = states()
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two sequences of three
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        varlen_attention_forward(module, query, key, value, None, position_ids=position_ids)


def test_options_the_kernel_cannot_apply_are_refused():
    module = nn.Module().train()
    query, key, value = states()
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout"):
        varlen_attention_forward(module, query, key, value, None, dropout=0.1, cu_seq_lens_q=cu, max_length_q=3)
    with pytest.raises(NotImplementedError, match="softcap"):
        varlen_attention_forward(module.eval(), query, key, value, None, cu_seq_lens_q=cu, max_length_q=3, softcap=30.0)
