"""Multi-turn rollouts with tools (`actor_rollout_ref.rollout.multi_turn`): verl's tool interface and tool
config format, ember's agent loop on its own engine, and the tools ember ships.

`loop.py` holds the loop; `turns.py` how a tool turn becomes tokens; `tool_parser.py` the Hermes call
format; `tool_session.py` how calls run (threads, time limits, errors); `tool_config.py` the YAML; `tools/`
the interface and the shipped tools. Imports point down: this package uses `ember.inference` (the engine)
and `ember.rollout` (its records), and nothing below it imports this package.
"""

from ember.agent.loop import AgentLoop, AgentOptions
from ember.agent.tool_config import load_tools

__all__ = ["AgentLoop", "AgentOptions", "load_tools"]
