"""An agent's next turn on ember's engine: a finished turn submitted with `hold_kv` keeps its KV blocks, and
`continue_turn` prefills only what came after it (the tool's tokens) over them. The continued turn draws the
tokens and log-probs a prefill of its whole context draws; held blocks go back when released, and make room
when waiting prompts or running sequences need it (that turn is then prefilled whole, with the same result)."""

from __future__ import annotations

import torch
from test_inference_engine import engine_for, tiny_model

from ember.rollout.base import SamplingParams

PROMPT = [5, 9, 13, 21, 34, 55, 89, 14, 23]
TOOL_TURN = [70, 71, 72, 73, 74]
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=8)  # sampled: draws keyed by seed and position
SEED = 11


def run(engine) -> list:
    finished = []
    while engine.has_unfinished():
        finished += engine.step(SAMPLING)
    return finished


def whole_context_turn(model, context: list[int], **config):
    """The reference: `context` prefilled whole, as a new prompt, in a fresh engine."""
    engine = engine_for(model, **config)
    engine.submit(context, [SEED], SAMPLING.max_new_tokens)
    return run(engine)[0]


def test_a_continued_turn_draws_what_a_whole_context_prefill_draws_and_computes_only_the_new_tokens():
    model = tiny_model("qwen2")
    engine = engine_for(model, num_kv_blocks=40)
    engine.submit(PROMPT, [SEED], SAMPLING.max_new_tokens, hold_kv=True)
    (first,) = run(engine)
    assert engine.block_manager.num_free_blocks < 40  # the finished turn holds its blocks
    context = PROMPT + first.generated_token_ids + TOOL_TURN
    computed = engine.prefill_tokens_computed
    engine.continue_turn(first.sequence_id, context, SEED, SAMPLING.max_new_tokens)
    (continued,) = run(engine)
    assert engine.prefill_tokens_computed - computed == len(TOOL_TURN) + 1  # the first turn's last token, the tool's
    expected = whole_context_turn(model, context, num_kv_blocks=40)
    assert continued.generated_token_ids == expected.generated_token_ids
    torch.testing.assert_close(torch.tensor(continued.log_probs), torch.tensor(expected.log_probs),
                               rtol=1e-5, atol=1e-5)
    engine.release_kv()
    assert engine.block_manager.num_free_blocks == 40


def test_held_blocks_make_room_and_a_turn_whose_blocks_went_back_is_prefilled_whole():
    model = tiny_model("llama")
    # 8 blocks of 4 tokens: a held 17-token turn (4 blocks with keys and values) and a 20-token sequence (5) do
    # not fit together.
    engine = engine_for(model, num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=32)
    engine.submit(PROMPT, [SEED], SAMPLING.max_new_tokens, hold_kv=True)
    (first,) = run(engine)
    engine.submit(PROMPT[::-1] + [3, 4, 5], [SEED + 1], SAMPLING.max_new_tokens)
    run(engine)  # needs the held blocks before it finishes: they are given back
    assert not engine.scheduler.held and engine.block_manager.num_free_blocks == 8
    context = PROMPT + first.generated_token_ids + TOOL_TURN
    computed = engine.prefill_tokens_computed
    engine.continue_turn(first.sequence_id, context, SEED, SAMPLING.max_new_tokens)
    (continued,) = run(engine)
    assert engine.prefill_tokens_computed - computed == len(context)
    expected = whole_context_turn(model, context, num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=32)
    assert continued.generated_token_ids == expected.generated_token_ids
    engine.release_kv(continued.sequence_id)
    assert engine.block_manager.num_free_blocks == 8


def test_sleep_gives_held_blocks_back():
    engine = engine_for(tiny_model("qwen3"), num_kv_blocks=40)
    engine.submit(PROMPT, [SEED], SAMPLING.max_new_tokens, hold_kv=True)
    run(engine)
    engine.free_kv_cache()
    engine.allocate_kv_cache()
    assert not engine.scheduler.held and engine.block_manager.num_free_blocks == 40


def test_a_context_that_does_not_extend_the_held_tokens_is_prefilled_whole():
    """The held blocks are reused only under exactly the tokens they were computed for, even where the finished
    sequence's token list was changed afterwards (a scripted turn in tests)."""
    model = tiny_model("qwen2")
    engine = engine_for(model, num_kv_blocks=40)
    engine.submit(PROMPT, [SEED], SAMPLING.max_new_tokens, hold_kv=True)
    (first,) = run(engine)
    first.token_ids[len(PROMPT):] = [60, 61, 62]  # another first turn than the one sampled
    context = PROMPT + [60, 61, 62] + TOOL_TURN
    computed = engine.prefill_tokens_computed
    engine.continue_turn(first.sequence_id, context, SEED, SAMPLING.max_new_tokens)
    (continued,) = run(engine)
    assert engine.prefill_tokens_computed - computed == len(context)
    assert continued.generated_token_ids == whole_context_turn(model, context, num_kv_blocks=40).generated_token_ids
    engine.release_kv()
    assert engine.block_manager.num_free_blocks == 40


def test_a_waiting_turns_blocks_go_back_before_a_running_sequence_is_stopped():
    """A continued turn queued behind a full cache holds the blocks it took over; a running sequence that needs
    a block gets them (the turn is then prefilled whole when there is room) instead of the engine giving up."""
    model = tiny_model("llama")
    config = dict(num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=32, decode_window=1)
    engine = engine_for(model, **config)
    other = [8, 6, 4, 2, 1, 3, 5, 7, 9]
    engine.submit(PROMPT, [SEED], 5, hold_kv=True)  # 14 tokens: 4 blocks held when it ends
    engine.submit(other, [SEED + 1], 20, first_sequence_id=1)  # 14 tokens then too, in 4 blocks: none free
    finished = []
    while not finished:
        finished += engine.step(SAMPLING)
    (first,) = finished
    assert first.sequence_id == 0 and engine.block_manager.num_free_blocks == 0
    context = PROMPT + first.generated_token_ids + TOOL_TURN  # 19 tokens: one block more than it holds
    engine.continue_turn(first.sequence_id, context, SEED, SAMPLING.max_new_tokens)
    by_id = {sequence.sequence_id: sequence for sequence in run(engine)}  # the other needs a 5th block
    expected = whole_context_turn(model, context, **config)
    assert by_id[0].generated_token_ids == expected.generated_token_ids
    alone = engine_for(model, **config)
    alone.submit(other, [SEED + 1], 20, first_sequence_id=1)
    assert by_id[1].generated_token_ids == run(alone)[0].generated_token_ids
    engine.release_kv()  # the continued turn holds its blocks for a next one
    assert engine.block_manager.num_free_blocks == 8
