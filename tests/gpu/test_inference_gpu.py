"""ember's generation engine on a GPU: the Triton kernels against their PyTorch references,
CUDA graphs against eager steps, greedy tokens against transformers, and the bf16 mismatch
between rollout log-probs and a training forward (k3 below 1e-3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ember.inference import EngineConfig, LLMEngine
from ember.inference.attention import AttentionInputs, gathered_attention
from ember.inference.hashing import gumbel_noise, row_keys
from ember.inference.models.layers import PartialSumLinear
from ember.models.tiny import tiny_model_config
from ember.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 90, 2], [100], [64, 65, 1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15]] * 3


def model_of(dtype: torch.dtype, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    settings = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, initializer_range=0.05)
    config = tiny_model_config("qwen2", **(settings | overrides))
    return AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()


def engine_for(model, dtype: torch.dtype, **overrides) -> LLMEngine:
    settings = dict(max_model_len=160, max_num_seqs=6, max_num_batched_tokens=512, block_size=16, dtype=dtype,
                    device="cuda", num_kv_blocks=256)
    return LLMEngine(model.config, model.state_dict().items(), EngineConfig(**dict(settings, **overrides)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 24])
def test_paged_decode_kernel_equals_gathered_attention(dtype, window):
    from ember.inference.kernels.paged_decode import paged_decode_attention

    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim, heads, rows = 64, 16, 2, 64, 14, 9
    key_cache = torch.randn(blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    context = torch.tensor([1, 15, 16, 17, 63, 64, 65, 200, 300], device="cuda")
    tables = torch.stack([torch.randperm(blocks, device="cuda")[:20] for _ in range(rows)])
    queries = torch.randn(rows, heads, head_dim, device="cuda", dtype=dtype)
    inputs = AttentionInputs(slot_mapping=torch.zeros(rows, dtype=torch.long, device="cuda"),
                             query_lengths=torch.ones(rows, dtype=torch.long, device="cuda"), context_lengths=context,
                             block_tables=tables, block_size=block_size, is_decode=True)
    expected = gathered_attention(queries, key_cache, value_cache, inputs, head_dim**-0.5, window)
    actual = paged_decode_attention(queries, key_cache, value_cache, tables, context, head_dim**-0.5, window)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_norm_and_swiglu_kernels_equal_their_pytorch_references(dtype, rows):
    """The engine's Triton RMSNorm (with and without the residual add) and SwiGLU gating against the eager
    PyTorch math they replace (hidden 576 and intermediate 4864: neither a power of two nor a block multiple)."""
    import torch.nn.functional as F

    from ember.inference.kernels.norm_act import rms_norm, silu_and_mul
    from ember.inference.models.layers import _rms_norm

    torch.manual_seed(0)
    states = torch.randn(rows, 576, device="cuda", dtype=dtype)
    residual = torch.randn_like(states)
    weight = (1 + 0.1 * torch.randn(576, device="cuda")).to(dtype)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    normed, summed = rms_norm(states, weight, 1e-5)
    assert summed is None and normed.dtype == dtype and normed.shape == states.shape
    torch.testing.assert_close(normed, _rms_norm(states, weight, 1e-5), **tolerance)
    normed, summed = rms_norm(states, weight, 1e-5, residual=residual)
    torch.testing.assert_close(summed, states + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, _rms_norm(states + residual, weight, 1e-5), **tolerance)
    # a tensor-parallel block's float32 sum joins the residual: rounded to its dtype first, in the same kernel
    block_sum = torch.randn(rows, 576, device="cuda", dtype=torch.float32)
    normed, summed = rms_norm(block_sum, weight, 1e-5, residual=residual)
    assert summed.dtype == normed.dtype == dtype
    torch.testing.assert_close(summed, block_sum.to(dtype) + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, _rms_norm(block_sum.to(dtype) + residual, weight, 1e-5), **tolerance)
    gate_up = torch.randn(rows, 2 * 4864, device="cuda", dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as the fused projection gives them
    torch.testing.assert_close(silu_and_mul(gate, up), F.silu(gate) * up, **tolerance)


@pytest.mark.parametrize("window", [None, 24])
def test_fresh_prefill_on_the_varlen_kernel_equals_gathered_attention(window):
    """A prefill of whole prompts (nothing cached before) reads its keys back from their slots and runs
    the flash varlen kernel; the gathered, masked reference must agree (bf16, grouped heads 7:1)."""
    from ember.inference.attention import fresh_prefill_attention

    torch.manual_seed(0)
    block_size, kv_heads, head_dim, heads = 16, 2, 64, 14
    lengths = [1, 15, 16, 17, 63, 130]
    blocks_each = -(-max(lengths) // block_size)
    key_cache = torch.randn(blocks_each * len(lengths) + 1, block_size, kv_heads, head_dim, device="cuda",
                            dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    tables = (1 + torch.randperm(blocks_each * len(lengths), device="cuda")).view(len(lengths), blocks_each)
    slots = [int(tables[row, position // block_size]) * block_size + position % block_size
             for row, length in enumerate(lengths) for position in range(length)]
    inputs = AttentionInputs(
        slot_mapping=torch.tensor(slots, device="cuda"), query_lengths=torch.tensor(lengths, device="cuda"),
        context_lengths=torch.tensor(lengths, device="cuda"), block_tables=tables, block_size=block_size,
        is_decode=False, host_query_lengths=lengths, fresh=True)
    queries = torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    expected = gathered_attention(queries, key_cache, value_cache, inputs, head_dim**-0.5, window)
    actual = fresh_prefill_attention(queries, key_cache, value_cache, inputs, head_dim**-0.5, window)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_cache_kernel_equals_rotation_and_index_copies(dtype):
    from ember.inference.attention import write_kv_cache
    from ember.inference.kernels.rope_cache import rope_and_cache
    from ember.inference.models.rope import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, head_dim, tokens = 14, 2, 64, 300
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 1000000.0}).cuda()
    rotary.reset_tables()
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)  # strided q/k/v views
    queries, keys, values = (part.unflatten(-1, (-1, head_dim))
                             for part in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:tokens]
    caches = [torch.zeros(64, 16, kv_heads, head_dim, device="cuda", dtype=dtype) for _ in range(4)]
    rotated = rope_and_cache(queries, keys, values, rotary.cos, rotary.sin, positions, caches[0], caches[1], slots)
    expected_queries, expected_keys = rotary(positions, queries, keys)
    write_kv_cache(expected_keys, values, caches[2], caches[3], slots)
    one_ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20  # FMA or not may round the last bit differently
    torch.testing.assert_close(rotated, expected_queries, rtol=one_ulp, atol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], rtol=one_ulp, atol=1e-6)
    assert torch.equal(caches[1], caches[3])


def test_fused_sampling_kernel_draws_the_hashed_gumbel_argmax():
    from ember.inference.kernels.sample import fused_sample

    torch.manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda") * 4
    seeds, positions = torch.randint(0, 2**31, (64,), device="cuda"), torch.arange(64, device="cuda")
    keys = row_keys(seeds, positions)
    tokens, log_probs = fused_sample(logits, logits, seeds, positions, 1 / 0.7, 0.7)
    expected = (logits / 0.7 + gumbel_noise(keys, logits.shape[1])).argmax(-1)
    assert (tokens == expected).float().mean() > 0.98  # float rounding of log(-log(u)) may flip a near-tie
    reference = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(log_probs, reference, atol=1e-4, rtol=0)
    greedy, _ = fused_sample(logits, logits, None, None, 1.0, 1.0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_fp32_greedy_with_cuda_graphs_equals_transformers_generate_for_64_tokens():
    model = model_of(torch.float32)
    engine = engine_for(model, torch.float32)
    outputs = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=64, ignore_eos=True))
    assert engine.decoder.graphs, "decode steps ran without CUDA graphs"
    for prompt, output in zip(PROMPTS, outputs):
        expected = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=64,
                                  min_new_tokens=64, pad_token_id=0)[0, len(prompt):].tolist()
        assert output.generated_token_ids == expected


def test_cuda_graph_steps_equal_eager_steps_when_sampling_with_a_seed():
    model = model_of(torch.float32)
    sampling = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=48, seed=11)
    graphed = engine_for(model, torch.float32).generate(PROMPTS, sampling)
    eager = engine_for(model, torch.float32, use_cuda_graphs=False, max_num_seqs=32).generate(PROMPTS, sampling)
    assert [s.generated_token_ids for s in graphed] == [s.generated_token_ids for s in eager]


def test_bf16_rollout_log_probs_match_a_training_forward():
    model = model_of(torch.bfloat16)
    engine = engine_for(model, torch.bfloat16, max_num_seqs=64)
    outputs = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=96, seed=0, ignore_eos=True))
    differences = []
    with torch.no_grad():
        for output in outputs:
            ids = torch.tensor([output.token_ids], device="cuda")
            logits = model(ids).logits[0, output.prompt_length - 1 : -1].float()
            trained = torch.log_softmax(logits, -1).gather(1, ids[0, output.prompt_length:, None])[:, 0]
            differences.append(trained - torch.tensor(output.log_probs, device="cuda"))
    delta = torch.cat(differences)
    k3 = float((torch.exp(delta) - 1 - delta).mean())
    print(f"bf16 rollout vs training forward: mean |dlogp| {delta.abs().mean():.2e}, k3 {k3:.2e}")
    assert k3 < 1e-3


def test_a_small_cache_stays_through_sleep_with_its_graphs_and_tokens_stay_the_same():
    model = model_of(torch.bfloat16)
    engine = engine_for(model, torch.bfloat16)
    sampling = SamplingParams(do_sample=False, max_new_tokens=32, ignore_eos=True)
    before = [s.generated_token_ids for s in engine.generate(PROMPTS, sampling)]
    address, graphs = engine.kv_cache.address, dict(engine.decoder.graphs)
    engine.free_kv_cache()  # the tiny model's cache is far below 5% of the device: kept
    assert engine.kv_cache.is_allocated and engine.kv_cache.address == address
    engine.allocate_kv_cache()
    assert [s.generated_token_ids for s in engine.generate(PROMPTS, sampling)] == before
    assert engine.decoder.graphs.keys() >= graphs.keys()
    assert all(engine.decoder.graphs[size] is graph for size, graph in graphs.items())  # none captured again


def test_graphs_survive_sleep_unless_the_cache_comes_back_elsewhere_and_tokens_stay_the_same(monkeypatch):
    import ember.inference.engine

    monkeypatch.setattr(ember.inference.engine, "KV_CACHE_KEPT_OVER_SLEEP_FRACTION", 0.0)  # every cache is freed
    model = model_of(torch.bfloat16)
    engine = engine_for(model, torch.bfloat16)
    sampling = SamplingParams(do_sample=False, max_new_tokens=32, ignore_eos=True)
    before = [s.generated_token_ids for s in engine.generate(PROMPTS, sampling)]
    cache_bytes = sum(keys.nbytes + values.nbytes for keys, values in engine.kv_cache.layers)
    for hold_its_place in (False, True):  # the second time a block of the cache's size takes its old memory
        address = engine.kv_cache.address
        engine.free_kv_cache()
        assert engine.decoder.graphs  # kept while asleep: the tiny model's pool is far below the limit
        blocker = torch.empty(cache_bytes, dtype=torch.uint8, device="cuda") if hold_its_place else None
        engine.allocate_kv_cache()
        moved = engine.kv_cache.address != address
        assert bool(engine.decoder.graphs) is not moved
        assert [s.generated_token_ids for s in engine.generate(PROMPTS, sampling)] == before
        assert engine.decoder.graphs and engine.decoder.kv_address == engine.kv_cache.address
        del blocker


def test_a_split_output_projection_returns_the_unrounded_partial_sum():
    """Rollout TP's row-split projections hand the all-reduce fp32 partials (`PartialSumLinear`), so a
    block's output is rounded to bf16 once, as the unsplit product is."""
    torch.manual_seed(0)
    projection = PartialSumLinear(1536, 576, bias=True).cuda().to(torch.bfloat16)
    states = torch.randn(37, 1536, device="cuda", dtype=torch.bfloat16)
    partial = projection(states)
    expected = states.float() @ projection.weight.float().t() + projection.bias.float()
    assert partial.dtype == torch.float32
    torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-4)
    assert not torch.equal(partial, nn.Linear.forward(projection, states).float())  # bf16 would round each partial
