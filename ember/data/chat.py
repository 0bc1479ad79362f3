"""Chat-template helpers: check chat messages, render them to text and token ids, mark assistant tokens.

Prompts are always rendered to text with the tokenizer's own chat template and then
tokenized without adding special tokens (the template already wrote them), so the token
ids and the text ember logs are the same thing. Which tokens the assistant wrote is found
by rendering the conversation prefix by prefix: this works for any template whose earlier
turns do not change when later turns are added, and is an error otherwise.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from ember.data.parquet import SourceRow

Messages = list[dict[str, Any]]
# The roles chat templates know: OpenAI's (developer included), tool results as Qwen and Llama 3 name them.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_messages(row: SourceRow, column: str) -> Messages:
    """The chat messages in `row[column]`: a non-empty list of {role, content} with string values."""
    value = row.values[column]
    if not isinstance(value, list) or not value:
        raise row.error(column, f"expected a non-empty list of {{role, content}} messages, got {value!r:.200}")
    messages = []
    for position, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise row.error(
                column, f"message {position} is not a {{role, content}} mapping of strings: {message!r:.200}"
            )
        if message["role"] not in CHAT_ROLES:  # a template would render it as it pleases, or drop it silently
            raise row.error(column, f"message {position} has role {message['role']!r}, which is none of "
                                    f"{', '.join(CHAT_ROLES)}; fix the role in the data")
        # pyarrow fills keys that only other rows have with None; templates should not see them.
        messages.append({key: item for key, item in message.items() if item is not None})
    return messages


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """`messages` rendered to text by the tokenizer's chat template."""
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; use an instruct model's tokenizer "
            "or one whose tokenizer_config.json / chat_template.jinja defines it"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added around it (the template wrote them)."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode_chat_with_assistant_mask(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a mask that is 1 on the tokens of assistant turns.

    An assistant turn's tokens run from the end of the generation prompt that precedes it
    through its end-of-turn token; whitespace the template writes after that token (the
    newline between ChatML turns) is not part of it.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt=False, template_kwargs=template_kwargs)
    spans = []
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:position], True, template_kwargs)
        through = render_chat(tokenizer, messages[: position + 1], False, template_kwargs)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"the chat template of {tokenizer.name_or_path!r} renders earlier turns differently once later "
                f"turns are added (at message {position}), so assistant tokens cannot be located; "
                "use a prompt/response dataset or a template without history rewriting"
            )
        spans.append((len(before), len(through)))

    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoding["offset_mapping"]
    mask = [0] * len(offsets)
    for start, end in spans:
        inside = [index for index, (token_start, _) in enumerate(offsets) if start <= token_start < end]
        while inside and not text[slice(*offsets[inside[-1]])].strip():
            inside.pop()
        for index in inside:
            mask[index] = 1
    return list(encoding["input_ids"]), mask
