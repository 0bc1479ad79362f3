"""Which part of each weight a rank of ember's tensor-parallel engine keeps (`models/weight_shards.py`): the
blocks of column- and row-parallel layers, a key-value head shared by several ranks, the fused expert
gate/up halves, padded vocabulary rows, row-parallel biases counted once; a weight already cut to this
rank's part is taken as it is, and one of another split is refused naming it; the sizes each rank builds,
and models the ranks cannot split refused naming the key."""

from __future__ import annotations

import pytest
import torch

from ember.errors import UserError
from ember.inference.models.decoder import DecoderForCausalLM
from ember.inference.models.weight_shards import WeightShards, padded_vocab_size
from ember.inference.tensor_parallel import TensorParallel
from ember.models.tiny import tiny_model_config


def numbered(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_column_and_row_parallel_weights_keep_the_ranks_block():
    shards = WeightShards(size=2, rank=1, kv_heads=2, vocab_size=8)
    up = numbered(6, 3)
    assert torch.equal(shards.own_part("model.layers.0.mlp.up_proj.weight", up, torch.Size((3, 3))), up[3:])
    expert_gate = numbered(6, 3)  # a checkpoint's per-expert name
    assert torch.equal(shards.own_part("model.layers.0.mlp.experts.5.gate_proj.weight", expert_gate,
                                       torch.Size((3, 3))), expert_gate[3:])
    down = numbered(3, 6)
    assert torch.equal(shards.own_part("model.layers.0.mlp.shared_expert.down_proj.weight", down,
                                       torch.Size((3, 3))), down[:, 3:])
    norm = numbered(3)
    assert shards.own_part("model.layers.0.input_layernorm.weight", norm, torch.Size((3,))) is norm


def test_a_weight_already_cut_to_the_ranks_part_is_taken_as_it_is():
    shards = WeightShards(size=2, rank=1, kv_heads=2, vocab_size=8)
    part = numbered(3, 3)
    assert shards.own_part("model.layers.0.self_attn.q_proj.weight", part, torch.Size((3, 3))) is part


def test_fewer_key_value_heads_than_ranks_share_a_head():
    head_dim = 2
    keys = numbered(2 * head_dim, 3)  # two heads over four ranks: ranks 0, 1 read head 0; ranks 2, 3 head 1
    kept = [WeightShards(size=4, rank=rank, kv_heads=2, vocab_size=8).own_part(
        "model.layers.0.self_attn.k_proj.weight", keys, torch.Size((head_dim, 3))) for rank in range(4)]
    assert [torch.equal(part, keys[:head_dim]) for part in kept] == [True, True, False, False]
    assert torch.equal(kept[3], keys[head_dim:])


def test_fused_expert_gate_up_keeps_the_same_block_of_each_half():
    shards = WeightShards(size=2, rank=1, kv_heads=2, vocab_size=8)
    fused = numbered(3, 8, 2)  # experts, gate (4 rows) then up (4 rows), hidden
    part = shards.own_part("model.layers.0.mlp.experts.gate_up_proj", fused, torch.Size((3, 4, 2)))
    assert torch.equal(part, torch.cat([fused[:, 2:4], fused[:, 6:8]], dim=1))
    down = numbered(3, 2, 4)
    assert torch.equal(shards.own_part("model.layers.0.mlp.experts.down_proj", down, torch.Size((3, 2, 2))),
                       down[:, :, 2:])


def test_vocabulary_rows_are_padded_with_zeros_to_a_multiple_of_the_ranks():
    assert padded_vocab_size(127, 2) == 128 and padded_vocab_size(130, 4) == 132
    embedding = numbered(5, 2)  # 5 tokens over 4 ranks: 2 rows each, the last 3 rows padding
    parts = [WeightShards(size=4, rank=rank, kv_heads=4, vocab_size=5).own_part(
        "model.embed_tokens.weight", embedding, torch.Size((2, 2))) for rank in range(4)]
    assert torch.equal(torch.cat(parts[:3])[:5], embedding)
    assert not parts[2][1].any() and not parts[3].any()


def test_row_parallel_biases_are_added_by_the_first_rank_only():
    bias = numbered(4) + 1
    first, second = (WeightShards(size=2, rank=rank, kv_heads=2, vocab_size=8).own_part(
        "model.layers.0.self_attn.o_proj.bias", bias, torch.Size((4,))) for rank in (0, 1))
    assert first is bias and torch.equal(second, torch.zeros(4))


def test_a_weight_of_another_split_is_refused_naming_it():
    shards = WeightShards(size=2, rank=0, kv_heads=2, vocab_size=8)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has 2 along dimension 0.*whole "
                                         r"weight \(6\) or this rank's part \(3\)"):
        shards.own_part("model.layers.0.mlp.gate_proj.weight", numbered(2, 3), torch.Size((3, 3)))
    with pytest.raises(ValueError, match="lm_head.weight' has 6 rows"):
        shards.own_part("lm_head.weight", numbered(6, 3), torch.Size((4, 3)))


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("qwen2_moe", dict(moe_intermediate_size=42), "does not divide the model's 42 expert MLP width"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=66), "66 shared expert width"),
    ("llama", dict(num_attention_heads=8, num_key_value_heads=3), "3 key-value heads can neither be split"),
])
def test_a_model_the_ranks_cannot_split_is_refused_naming_the_key(arch, overrides, message):
    config = tiny_model_config(arch, vocab_size=16, **overrides)
    with torch.device("meta"), pytest.raises(UserError, match=message) as refused:
        DecoderForCausalLM(config, max_positions=8, tensor_parallel=TensorParallel(size=4))
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in str(refused.value)


def test_four_ranks_split_a_moe_model_and_share_its_two_key_value_heads():
    config = tiny_model_config("qwen2_moe", vocab_size=10, num_experts=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, max_positions=8, tensor_parallel=TensorParallel(size=4, rank=3))
    layer = model.model.layers[0]
    assert model.num_kv_heads == 1 and layer.self_attn.num_heads == 1
    assert layer.mlp.experts.gate_up_proj.shape == (2, 16, 64) and layer.mlp.shared_expert.up_proj.out_features == 16
    assert model.lm_head.weight.shape == (3, 64) and model.model.embed_tokens.first_row == 9
