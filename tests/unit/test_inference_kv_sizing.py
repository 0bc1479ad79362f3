"""Sizing the engine's KV cache from gpu_memory_utilization: the engine's own weights and the steps' activations count
against it, memory others hold only where it leaves less free."""

import pytest
import torch

from ember.inference.kv_cache import (activation_reserve_bytes, kv_block_bytes, kv_blocks_to_allocate,
                                     num_kv_blocks_for_memory)

GIB = 2**30


def test_the_engines_weights_and_reserved_activations_come_off_its_share():
    # 0.5 of 80 GiB = 40 GiB; the engine's weights 15 GiB; 6 GiB kept for activations: 19 GiB of 1 GiB blocks.
    assert num_kv_blocks_for_memory(80 * GIB, 65 * GIB, 0.5, GIB, own_bytes=15 * GIB) == 25
    assert num_kv_blocks_for_memory(80 * GIB, 65 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=15 * GIB) == 19


def test_a_colocated_trainers_memory_counts_only_where_it_leaves_less_free():
    # A 7B LoRA actor's bf16 base (15 GiB) beside the engine's 15 GiB: 0.5 of 80 GiB still leaves the engine 19 GiB.
    assert num_kv_blocks_for_memory(80 * GIB, 45 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=15 * GIB) == 19
    # ...but never more than is free: 25 GiB free, 6 kept for activations.
    assert num_kv_blocks_for_memory(80 * GIB, 25 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=15 * GIB) == 19
    assert num_kv_blocks_for_memory(80 * GIB, 20 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=15 * GIB) == 14


def test_no_room_names_the_settings_to_change():
    with pytest.raises(ValueError, match="gpu_memory_utilization.*weights take 38.0 GiB.*activations.*max_num_seqs"):
        num_kv_blocks_for_memory(80 * GIB, 40 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=38 * GIB)
    with pytest.raises(ValueError, match="6.0 GiB is free"):
        num_kv_blocks_for_memory(80 * GIB, 6 * GIB, 0.5, GIB, reserved_bytes=6 * GIB, own_bytes=15 * GIB)


def test_activation_reserve_covers_the_logits_of_every_slot_and_a_full_prefill():
    # Qwen2.5-0.5B: hidden 896, intermediate 4864, vocab 151936.
    small = activation_reserve_bytes(896, 4864, 151936, 8192, 256, torch.bfloat16)
    more_slots = activation_reserve_bytes(896, 4864, 151936, 8192, 1024, torch.bfloat16)
    longer_prefill = activation_reserve_bytes(896, 4864, 151936, 65536, 256, torch.bfloat16)
    assert more_slots - small == 768 * 151936 * 10  # per slot: bf16 logits and 8 bytes of float32 work per entry
    assert longer_prefill > small
    assert small > 256 * 151936 * 2  # at least the bf16 logits themselves
    assert kv_block_bytes(24, 16, 2, 64, torch.bfloat16) == 2 * 24 * 16 * 2 * 64 * 2


def test_the_cache_holds_what_max_num_seqs_full_sequences_can_use_and_no_more():
    # 256 sequences of at most 10 blocks: 2560 blocks whatever the memory would allow.
    assert kv_blocks_to_allocate(256, 10, fit_in_memory=100_000) == 2560
    assert kv_blocks_to_allocate(256, 10, fit_in_memory=1000) == 1000  # memory is the bound
    assert kv_blocks_to_allocate(256, 10) == 2560  # no memory bound (CPU)


def test_sleep_keeps_a_cache_of_at_most_five_percent_of_the_device_and_frees_a_larger_one():
    from ember.inference.engine import keeps_kv_cache_over_sleep

    # SmolLM2-135M, 1024 sequences of 140 tokens (+ a decode window of 16): 10,240 blocks of 360 KiB, 3.5 GiB
    assert keeps_kv_cache_over_sleep(10_240 * kv_block_bytes(30, 16, 3, 64, torch.bfloat16), 80 * GIB)
    assert keeps_kv_cache_over_sleep(4 * GIB, 80 * GIB)
    assert not keeps_kv_cache_over_sleep(5 * GIB, 80 * GIB)  # e.g. Qwen2.5-0.5B's 1024 x 1024 tokens: 13 GiB


def test_the_cache_counts_its_bytes_as_allocated():
    from ember.inference.kv_cache import KVCache

    cache = KVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                    device=torch.device("cpu"))
    allocated = sum(keys.untyped_storage().nbytes() for keys, _ in cache.layers[:1])  # one storage for all layers
    assert cache.nbytes == allocated == 5 * kv_block_bytes(3, 4, 2, 8, torch.bfloat16)
