"""A scripted first turn for multi-turn runs on a tiny random model, which never writes a tool call itself:
the engine's step is wrapped so that each sample's first model turn (a context without the call yet) becomes
the given call + <|im_end|>, the call a trained model would write. Everything after it is real: the tool
runs, its turn is appended as tokens, the model's next turn is sampled. The forced tokens carry rollout
log-probs of -1.0, so a run's mismatch metrics mean nothing."""

from __future__ import annotations

from ember.inference.engine import LLMEngine


def force_first_turn(monkeypatch) -> list[int]:
    """Wrap `LLMEngine.step`; returns the call's token list, to be filled (`call_tokens`) once the tokenizer is
    known."""
    real_step = LLMEngine.step
    call: list[int] = []

    def step(engine, sampling):
        finished = real_step(engine, sampling)
        for sequence in finished:
            context = sequence.token_ids[:sequence.prompt_length]
            if not any(context[start:start + len(call)] == call for start in range(len(context))):
                tokens = call[:sequence.max_new_tokens]
                sequence.token_ids[sequence.prompt_length:] = tokens
                sequence.log_probs[:] = [-1.0] * len(tokens)
                sequence.finish_reason = "stop"
        return finished

    monkeypatch.setattr(LLMEngine, "step", step)
    return call


def call_tokens(tokenizer, text: str) -> list[int]:
    """`text` (a Hermes <tool_call> block) and the end of the turn, as the model's tokens."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
