"""A tool turn as tokens: only the new turn's text is rendered with the chat template and tokenised; the tokens
the model sampled are never re-rendered or re-tokenised (re-tokenising a whole conversation each turn gives
other tokens than were sampled, and the trainer would then score tokens the policy never chose).

How the delta is found: the template renders a fixed conversation [user, assistant] once (`base`), and
the same conversation followed by the turn's tool messages with the generation prompt (`full`); the turn's
text is `full` after `base`. The model's turn ended with a stop token; what the template writes after that
token to close an assistant message (Qwen's "\n" after <|im_end|>) is not in the model's tokens, so it
starts the turn's text. A template whose `full` does not extend `base` (it rewrites earlier messages) is
refused by name, since no delta of it exists.
"""

from __future__ import annotations

from ember.errors import UserError

_USER, _ASSISTANT = "U", "A"  # placeholders of the fixed conversation; their text never reaches the model


class ToolTurnRenderer:
    """Token ids of a tool turn (tool messages + the next assistant prompt) for one tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.base_messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        self.base = tokenizer.apply_chat_template(self.base_messages, tokenize=False)
        self.assistant_closing = self.base[self.base.rindex(_ASSISTANT) + len(_ASSISTANT):]
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""

    def render(self, tool_texts: list[str], last_model_token: int) -> list[int]:
        """Tokens that follow a model turn ending with `last_model_token` (its stop token): the rest of the
        assistant message's closing, one tool message per text, and the next assistant prompt."""
        messages = self.base_messages + [{"role": "tool", "content": text} for text in tool_texts]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.base):
            raise UserError("the chat template renders a conversation with tool messages differently from the "
                            "same conversation without them, so a tool turn cannot be appended as tokens; use a "
                            "chat template that only appends (data.chat_template)")
        stop_text = self.tokenizer.decode([last_model_token])
        closing = self.assistant_closing
        rest_of_closing = closing[len(stop_text):] if closing.startswith(stop_text) else closing
        return self.tokenizer.encode(rest_of_closing + full[len(self.base):], add_special_tokens=False)


def truncate_tool_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters plus a marker (verl's rule): left keeps the start, right the end,
    middle both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "\n\n...(truncated)\n\n" + text[len(text) - (limit - half):]
