"""ember's core attention for megatron-core's local layer spec: a packed THD row (each sequence attending causally to
itself, one SDPA call per sequence on a CPU) computes what the padded batch with ember's mask computes at every real
token; grouped-query heads included."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from ember.engines.megatron.attention import sdpa_core_attention_class  # noqa: E402
from ember.engines.megatron.model_inputs import padded_attention_mask  # noqa: E402

HEADS, GROUPS, DIM = 4, 2, 8
LENGTHS = [3, 6, 1, 4]


def attention():
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                               use_cpu_initialization=True)
    return sdpa_core_attention_class()(config, layer_number=1, attn_mask_type=None, attention_type="self")


def packed_params(lengths: list[int]) -> PackedSeqParams:
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def test_packed_sequences_attend_as_the_padded_masked_batch_does():
    generator = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    # [s, b, heads, dim], each sample left-padded as prompts are
    query = torch.randn(width, len(LENGTHS), HEADS, DIM, generator=generator)
    key, value = (torch.randn(width, len(LENGTHS), GROUPS, DIM, generator=generator) for _ in range(2))
    real = torch.stack([torch.arange(width) >= width - length for length in LENGTHS])  # [b, s]
    module = attention()
    padded = module(query, key, value, padded_attention_mask(real.long())).view(width, len(LENGTHS), HEADS * DIM)

    def packed_row(tensor):  # the real tokens, sample after sample: [t, heads, dim]
        return tensor.transpose(0, 1)[real]

    packed = module(packed_row(query), packed_row(key), packed_row(value), None,
                    packed_seq_params=packed_params(LENGTHS))
    assert packed.shape == (sum(LENGTHS), HEADS * DIM)
    torch.testing.assert_close(packed, padded.transpose(0, 1)[real], atol=1e-6, rtol=0)


def test_a_sequence_sees_nothing_of_the_one_before_it():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(7, HEADS, DIM, generator=generator)
    key, value = (torch.randn(7, GROUPS, DIM, generator=generator) for _ in range(2))
    module = attention()
    together = module(query, key, value, None, packed_seq_params=packed_params([3, 4]))
    alone = module(query[3:], key[3:], value[3:], None, packed_seq_params=packed_params([4]))
    torch.testing.assert_close(together[3:], alone, atol=1e-6, rtol=0)


def test_a_packed_format_other_than_thd_is_refused():
    params = packed_params([2])
    params.qkv_format = "sbhd"
    with pytest.raises(ValueError, match="'sbhd'.*'thd' format only"):
        attention()(torch.zeros(2, HEADS, DIM), torch.zeros(2, GROUPS, DIM), torch.zeros(2, GROUPS, DIM), None,
                    packed_seq_params=params)
