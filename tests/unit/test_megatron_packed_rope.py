"""The packed row's rotary embedding in one pass equals rotating each sequence on its own from position 0."""

import pytest
import torch

pytest.importorskip("megatron.core")


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


def test_positions_restart_at_every_sequence():
    from ember.engines.megatron.packed_rope import positions_in_sequences

    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert positions_in_sequences(cu_seqlens, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


def test_one_pass_rotates_a_packed_row_as_megatron_core_does_per_sequence():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ember.engines.megatron import packed_rope

    packed_rope.install()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    angles = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron-core's table layout: [32, 1, 1, 8]
    cu_seqlens = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    row = torch.randn(20, 4, 8, requires_grad=True)
    ours = packed_rope.packed_rotary_pos_emb(row, freqs, config, cu_seqlens=cu_seqlens, cp_group=_OneRank())
    # megatron-core's meaning of a packed row: each sequence rotated from position 0, as an unpacked one
    bounds = cu_seqlens.tolist()
    theirs = torch.cat([apply_rotary_pos_emb(row[start:end].unsqueeze(1), freqs[:end - start], config,
                                             cp_group=_OneRank()).squeeze(1)
                        for start, end in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert not torch.allclose(ours[6:13], apply_rotary_pos_emb(row.unsqueeze(1), freqs[:20], config,
                                                                 cp_group=_OneRank()).squeeze(1)[6:13])
    grad = torch.randn_like(ours)
    (ours_grad,) = torch.autograd.grad(ours, row, grad)
    (theirs_grad,) = torch.autograd.grad(theirs, row, grad)
    torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-6, rtol=0)
