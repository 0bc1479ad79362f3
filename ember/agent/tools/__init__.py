"""Tools the agent loop can call: verl's interface (`base.py`) and the tools ember ships."""

from ember.agent.tools.base import BaseTool, ToolResponse

__all__ = ["BaseTool", "ToolResponse"]
