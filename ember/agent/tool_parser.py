"""Tool calls in a model turn's text, in the Hermes format (`multi_turn.format=hermes`, as Qwen2.5/Qwen3 write
them and verl's HermesToolParser reads them):

    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>

Every `<tool_call>...</tool_call>` block holding a JSON object with a string `name` and an object (or a JSON
string of one) `arguments` is a call; a block that is not is a malformed call, counted, and not run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict[str, Any]


def parse_hermes_tool_calls(text: str) -> tuple[list[ToolCall], int]:
    """The well-formed calls of `text`, in order, and how many blocks were malformed."""
    calls, malformed = [], 0
    for body in _TOOL_CALL.findall(text):
        call = _parse_call(body)
        if call is None:
            malformed += 1
        else:
            calls.append(call)
    return calls, malformed


def _parse_call(body: str) -> ToolCall | None:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(parsed["name"], arguments) if isinstance(arguments, dict) else None
