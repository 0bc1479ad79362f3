"""The tool interface of verl (`verl/tools/base_tool.py`): a tool is a class with async `create`, `execute`,
`calc_reward` and `release`, built from one entry of the tool config YAML (`config`, `tool_schema`).

One instance of a tool class serves every sample; `create` makes a per-sample instance (its id keys the
tool's own state, e.g. the sample's ground truth), `execute` runs one call with the model's arguments,
`calc_reward` scores the instance at the end of the sample, `release` drops it. The agent loop
(`ember/agent/loop.py`) calls them in that order, each in a worker thread under
`multi_turn.tool_timeout`, so a tool may block or sleep without stopping generation.

verl's tools return a `ToolResponse` (newer verl) or a plain string (older verl) from `execute`, and an id or
an (id, ToolResponse) pair from `create`; `tool_text` and `instance_id_of` read either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4


@dataclass
class ToolResponse:
    """What a tool call answers; only text reaches the model here."""

    text: str | None = None


class BaseTool:
    """A tool the model can call by name; subclasses override `execute` (and `create`, `calc_reward`,
    `release` when they keep per-sample state)."""

    def __init__(self, config: dict, tool_schema: dict):
        """config: the entry's `config` mapping; tool_schema: its OpenAI function schema
        ({"type": "function", "function": {"name", "description", "parameters"}})."""
        self.config = config
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        """The schema the chat template renders into the prompt (`tools=`)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        """A per-sample instance; kwargs are the sample's `extra_info.tools_kwargs[name].create_kwargs`."""
        return instance_id or str(uuid4())

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse | str, float, dict]:
        """Run one call: (response, step reward, metrics)."""
        raise NotImplementedError(f"tool {self.name} ({type(self).__name__}) does not implement execute")

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The instance's reward at the end of its sample (reported beside the sample as tool_rewards)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Drop the instance's state."""


def tool_text(response: Any) -> str:
    """The text of what `execute` returned: a ToolResponse (or anything with `.text`), a dict with "text", or a str."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return str(response.get("text") or "")
    if hasattr(response, "text"):
        return response.text or ""
    raise TypeError(f"a tool's execute returned {type(response).__name__}; return a ToolResponse or a str")


def instance_id_of(created: Any) -> str:
    """The instance id from what `create` returned: the id, or verl's newer (id, ToolResponse) pair."""
    return created[0] if isinstance(created, tuple) else created
