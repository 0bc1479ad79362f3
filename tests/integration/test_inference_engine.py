"""ember's generation engine on tiny random fp32 models (CPU), checked against transformers.

Greedy tokens equal transformers' `generate` with continuous batching, small KV blocks,
shared prefills and preemption; log-probs equal a teacher-forced forward; first-token
frequencies follow softmax(logits / T); update_weights and sleep/wake work end to end.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ember.inference import EngineConfig, LLMEngine
from ember.inference.engine import GRAPHS_KEPT_OVER_SLEEP_BYTES
from ember.models.tiny import tiny_model_config
from ember.rollout.base import SamplingParams
from ember.rollout.ember_rollout import EmberRollout

VOCAB = 128
PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 90, 2], [100], [64, 65, 1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15]]
DENSE_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB, **overrides) -> PreTrainedModel:
    """A tiny random fp32 HF model; a wide init spreads the logits, so argmax has no near-ties."""
    torch.manual_seed(seed)
    config = tiny_model_config(arch, vocab_size=vocab_size, initializer_range=0.1, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def engine_config(**overrides) -> EngineConfig:
    settings = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=96, block_size=4, dtype=torch.float32)
    return EngineConfig(**dict(settings, **overrides))


def engine_for(model: PreTrainedModel, **overrides) -> LLMEngine:
    return LLMEngine(model.config, model.state_dict().items(), engine_config(**overrides))


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, stop_token_ids=()) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop_token_ids) or None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


def teacher_forced_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_greedy_equals_transformers_generate_with_refilled_slots_and_small_blocks(arch, fuse):
    model = tiny_model(arch, attention_bias=True) if arch == "llama" else tiny_model(arch)  # llama: q/k/v/o biases too
    unstopped = hf_greedy(model, PROMPTS[0], 64)
    stop = unstopped[5]  # a token the first prompt emits after a few steps: it stops early, its slot is refilled
    expected = [hf_greedy(model, prompt, 64, stop_token_ids=(stop,)) for prompt in PROMPTS]
    engine = engine_for(model, fuse_projections=fuse)
    assert bool(engine.model.fused_parameters) == fuse

    outputs = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=64, stop_token_ids=(stop,)))

    assert [output.generated_token_ids for output in outputs] == expected
    assert outputs[0].finish_reason == "stop" and outputs[0].generated_token_ids[-1] == stop
    assert {output.finish_reason for output in outputs if len(output.generated_token_ids) == 64} <= {"length", "stop"}
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),
        dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=16)),
    ],
    ids=["tied-embeddings", "llama3-rope-scaling"],
)
def test_greedy_equals_transformers_loaded_from_a_saved_directory(tmp_path, overrides):
    model = tiny_model("llama", **overrides)
    model.save_pretrained(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, engine_config())
    outputs = engine.generate(PROMPTS[:3], SamplingParams(do_sample=False, max_new_tokens=40))
    assert [output.generated_token_ids for output in outputs] == [hf_greedy(model, p, 40) for p in PROMPTS[:3]]


def test_n_samples_share_one_prefill_and_come_back_grouped_by_prompt():
    model = tiny_model("qwen3")
    engine = engine_for(model, max_num_seqs=8)
    prompts = PROMPTS[:3]  # 3, 7 and 1 tokens: the samples copy a partly filled last block

    outputs = EmberRollout(engine).generate(prompts, SamplingParams(n=3, do_sample=False, max_new_tokens=20))

    assert engine.prefill_tokens_computed == sum(len(prompt) for prompt in prompts)
    assert [output.prompt_index for output in outputs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    expected = [hf_greedy(model, prompt, 20) for prompt in prompts]
    assert [output.token_ids for output in outputs] == [tokens for tokens in expected for _ in range(3)]


def test_preemption_when_blocks_run_out_keeps_outputs_exact_and_frees_everything():
    model = tiny_model("llama")
    # 24 blocks of 4 tokens hold one 96-token sequence, but not 4 sequences of ~70 tokens.
    engine = engine_for(model, max_num_seqs=4, num_kv_blocks=24)
    outputs = engine.generate(PROMPTS[:4], SamplingParams(do_sample=False, max_new_tokens=60))
    assert [output.generated_token_ids for output in outputs] == [hf_greedy(model, p, 60) for p in PROMPTS[:4]]
    assert engine.prefill_tokens_computed > sum(len(p) for p in PROMPTS[:4])  # someone was prefilled again
    assert engine.block_manager.num_free_blocks == 24


def test_the_default_cache_runs_max_num_seqs_full_length_sequences_with_no_preemption():
    # Every sequence runs to max_model_len with a decode window of 16 reserved ahead: the default cache
    # (`kv_blocks_to_allocate`) is exactly what that can use, so no one is ever prefilled again.
    model = tiny_model("llama")
    prompts = [prompt[:4] for prompt in PROMPTS[:4]]
    engine = engine_for(model, max_num_seqs=4, max_model_len=40, decode_window=16)
    assert engine.num_kv_blocks == 4 * engine.config.blocks_for(40 + 16)
    engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=40 - 4))
    assert engine.prefill_tokens_computed == sum(len(p) for p in prompts)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("window", [3, 16])
def test_decode_windows_give_the_tokens_of_single_steps_through_stops_and_preemption(window):
    model = tiny_model("qwen2")
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=5, stop_token_ids=(7, 11, 13))
    single = engine_for(model, max_num_seqs=4, decode_window=1).generate(PROMPTS, sampling)
    # 24 blocks of 4 tokens: 4 sequences reserving a window ahead run out, and some are preempted.
    windowed_engine = engine_for(model, max_num_seqs=4, num_kv_blocks=24, decode_window=window)
    windowed = windowed_engine.generate(PROMPTS, sampling)
    assert {output.finish_reason for output in single} == {"stop", "length"}
    assert [(o.generated_token_ids, o.finish_reason) for o in windowed] == [
        (o.generated_token_ids, o.finish_reason) for o in single
    ]
    for ours, reference in zip(windowed, single):
        torch.testing.assert_close(torch.tensor(ours.log_probs), torch.tensor(reference.log_probs), atol=1e-5, rtol=0)
    assert windowed_engine.prefill_tokens_computed > sum(len(p) for p in PROMPTS)  # someone was prefilled again
    assert windowed_engine.block_manager.num_free_blocks == 24


def test_chunked_prefill_gives_the_tokens_of_whole_prefills():
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=3, max_num_batched_tokens=3)  # prompts of up to 9 tokens: 3 chunks
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=2)
    chunked = engine.generate(PROMPTS, sampling)
    whole = engine_for(model, max_num_seqs=3).generate(PROMPTS, sampling)
    assert engine.prefill_tokens_computed == sum(len(p) for p in PROMPTS)  # each prompt computed once
    assert [o.generated_token_ids for o in chunked] == [o.generated_token_ids for o in whole]
    greedy = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=16))
    assert [o.generated_token_ids for o in greedy] == [hf_greedy(model, p, 16) for p in PROMPTS]


def test_sampled_log_probs_equal_teacher_forced_log_softmax_of_scaled_logits():
    model = tiny_model("qwen2")
    sampling = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=24, seed=1)
    outputs = EmberRollout(engine_for(model)).generate(PROMPTS[:3], sampling)
    for output in outputs:
        expected = teacher_forced_log_probs(model, PROMPTS[output.prompt_index], output.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(output.log_probs), expected, atol=1e-4, rtol=0)
    assert len({tuple(output.token_ids) for output in outputs}) > 1  # it did sample


def test_first_token_frequencies_follow_softmax_and_seeds_reproduce():
    model = tiny_model("llama")
    prompt, temperature, draws = [5, 9, 13], 0.8, 20000
    with torch.no_grad():
        probabilities = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, dim=-1)
    engine = engine_for(model, max_num_seqs=draws, max_model_len=8, max_num_batched_tokens=8)
    sampling = SamplingParams(n=draws, temperature=temperature, max_new_tokens=1, seed=7)

    tokens = [output.generated_token_ids[0] for output in engine.generate([prompt], sampling)]

    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probabilities.double() * draws
    kept = expected >= 5  # pool the rare tokens into one bin, as the chi-square test needs
    observed_bins, expected_bins = counts[kept], expected[kept]
    if not kept.all():
        observed_bins = torch.cat([observed_bins, counts[~kept].sum()[None]])
        expected_bins = torch.cat([expected_bins, expected[~kept].sum()[None]])
    chi_square = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    degrees = len(observed_bins) - 1
    assert chi_square < degrees + 5 * math.sqrt(2 * degrees)  # about p < 1e-4 for these degrees of freedom

    again = [output.generated_token_ids[0] for output in engine.generate([prompt], sampling)]
    other_seed = engine.generate([prompt], SamplingParams(n=200, temperature=temperature, max_new_tokens=1, seed=8))
    assert again == tokens
    assert [output.generated_token_ids[0] for output in other_seed] != tokens[:200]


def test_seeded_samples_do_not_depend_on_batch_slots():
    model = tiny_model("mistral")
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3)
    wide = engine_for(model, max_num_seqs=10).generate(PROMPTS, sampling)
    narrow = engine_for(model, max_num_seqs=2).generate(PROMPTS, sampling)
    assert [o.generated_token_ids for o in wide] == [o.generated_token_ids for o in narrow]


def test_a_batch_split_in_two_calls_draws_what_one_call_draws():
    """What two data-parallel ranks do with their shares of a batch, in one process."""
    from dataclasses import replace

    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=10)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)
    whole = [o.generated_token_ids for o in engine.generate(PROMPTS, sampling)]
    first = engine.generate(PROMPTS[:2], sampling)
    second = engine.generate(PROMPTS[2:], replace(sampling, first_prompt_index=2))
    assert [o.generated_token_ids for o in first + second] == whole
    unshifted = engine.generate(PROMPTS[2:], sampling)  # what per-call numbering drew: other samples
    assert [o.generated_token_ids for o in unshifted] != whole[4:]


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
def test_update_weights_switches_to_the_new_model_and_sleep_frees_the_cache(fuse):
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    rollout = EmberRollout(engine_for(first, fuse_projections=fuse))
    sampling = SamplingParams(do_sample=False, max_new_tokens=16)
    before = [output.token_ids for output in rollout.generate(PROMPTS[:3], sampling)]
    assert before == [hf_greedy(first, p, 16) for p in PROMPTS[:3]]

    rollout.sleep()
    assert not rollout.engine.kv_cache.is_allocated
    with pytest.raises(RuntimeError, match="wake"):
        rollout.generate(PROMPTS[:3], sampling)
    rollout.update_weights(second.named_parameters())
    rollout.wake()

    after = [output.token_ids for output in rollout.generate(PROMPTS[:3], sampling)]
    assert after == [hf_greedy(second, p, 16) for p in PROMPTS[:3]]
    assert after != before


def test_captured_graphs_survive_sleep_only_when_the_cache_comes_back_at_the_same_address(monkeypatch):
    engine = engine_for(tiny_model("llama"))
    keys, values = engine.kv_cache.layers[1]  # one allocation, viewed per layer
    assert keys.is_contiguous() and keys.data_ptr() - engine.kv_cache.address == 2 * keys.nbytes
    assert values.data_ptr() - keys.data_ptr() == keys.nbytes
    decoder = engine.decoder
    for address_at_capture in (0x1000, 0x2000):  # the cache comes back at 0x1000 (where the CPU allocator puts it is not ours to choose)
        monkeypatch.setattr(type(engine.kv_cache), "address", property(lambda cache: 0x1000 if cache.layers else None))
        decoder.graphs[("rows", 8)] = object()  # no graphs on CPU: a stand-in for a captured one
        decoder.kv_address = address_at_capture
        engine.free_kv_cache()
        assert decoder.graphs and not engine.kv_cache.is_allocated  # kept while asleep
        engine.allocate_kv_cache()
        assert bool(decoder.graphs) is (address_at_capture == 0x1000)
    decoder.graphs[("rows", 8)], decoder.kv_address = object(), 0x1000
    decoder.graph_pool_bytes = GRAPHS_KEPT_OVER_SLEEP_BYTES + 1  # graphs holding more memory go with the cache
    engine.free_kv_cache()
    assert not decoder.graphs and decoder.graph_pool_bytes == 0


def test_a_cache_that_no_longer_fits_at_wake_up_names_the_settings_to_change(monkeypatch):
    engine = engine_for(tiny_model("llama"))
    engine.free_kv_cache()

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(engine.kv_cache, "allocate", out_of_memory)
    with pytest.raises(RuntimeError, match="no longer fits at wake-up.*gpu_memory_utilization.*param_offload"):
        engine.allocate_kv_cache()


def test_fused_projections_are_filled_by_copy_when_the_rest_is_shared():
    model, source = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    engine = engine_for(model, fuse_projections=True)
    live = dict(source.named_parameters())
    engine.load_weights(live.items(), share=True)
    parameters = dict(engine.model.named_parameters())
    fused = engine.model.fused_parameters
    assert "model.layers.0.self_attn.k_proj.bias" in fused and "model.layers.1.mlp.up_proj.weight" in fused
    for name, parameter in parameters.items():
        assert (parameter.data_ptr() == live[name].data_ptr()) == (name not in fused), name
        torch.testing.assert_close(parameter, live[name], rtol=0, atol=0)
    attention = engine.model.model.layers[0].self_attn
    assert attention.k_proj.weight.data_ptr() == attention.qkv_weight[attention.num_heads * attention.head_dim:].data_ptr()
    outputs = engine.generate(PROMPTS[:3], SamplingParams(do_sample=False, max_new_tokens=16))
    assert [output.generated_token_ids for output in outputs] == [hf_greedy(source, p, 16) for p in PROMPTS[:3]]


def test_prompt_longer_than_max_model_len_fails_naming_the_setting():
    engine = engine_for(tiny_model("llama"), max_model_len=16, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=8))
