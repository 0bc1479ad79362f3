"""One sample's use of the tools: its tool instances, its calls, each run in a thread of its own under a
time limit.

Each call runs `asyncio.run` of the tool's coroutines in a new daemon thread, so a tool may block, sleep or
spin without holding up generation or other samples' tools. A call that raises, or is not finished at
`multi_turn.tool_timeout`, is a failed call: its text tells the model so ("Error when executing tool: ...",
verl's wording), and it is counted in the sample's `tool_errors`. A Python thread cannot be killed, so a
call still running at its limit is abandoned (a daemon thread never keeps the process alive); tools that
start processes kill them at their own limits (`tools/python_code.py`).

The sample's instance of each tool is created on its first call (with the sample's
`extra_info.tools_kwargs[name].create_kwargs`, verl's data format); when the sample ends, `calc_reward`
and `release` run on each instance it created.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

from ember.agent.tool_parser import ToolCall
from ember.agent.tools.base import instance_id_of, tool_text


def run_in_thread(coroutine_function, *args) -> Future:
    """`coroutine_function(*args)` run to completion in a new daemon thread; its result (or exception) as a Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(asyncio.run(coroutine_function(*args)))
        except BaseException as error:  # a tool's SystemExit or KeyboardInterrupt fails only its call
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="ember-tool-call").start()
    return future


class ToolSession:
    """The tool instances and calls of one sample."""

    def __init__(self, tools: dict, tools_kwargs: dict[str, Any], timeout: float):
        self.tools = tools
        self.tools_kwargs = tools_kwargs or {}
        self.timeout = timeout
        self.instances: dict[str, str] = {}  # tool name -> this sample's instance id
        self._creating = threading.Lock()  # two calls of one turn to one tool create one instance

    def start_calls(self, calls: list[ToolCall]) -> tuple[list[Future], float]:
        """The turn's calls, each started in its own thread, and the time by which they must be done."""
        return [run_in_thread(self._call, call) for call in calls], time.monotonic() + self.timeout

    async def _call(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            raise LookupError(f"no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}")
        with self._creating:
            if call.name not in self.instances:
                create_kwargs = self.tools_kwargs.get(call.name, {}).get("create_kwargs", {})
                self.instances[call.name] = instance_id_of(await tool.create(None, **create_kwargs))
        response, _step_reward, _metrics = await tool.execute(self.instances[call.name], call.arguments)
        return tool_text(response)

    def start_closing(self) -> tuple[Future, float]:
        """calc_reward and release of every instance this sample created, started in a thread."""
        return run_in_thread(self._close), time.monotonic() + self.timeout

    async def _close(self) -> tuple[dict[str, float], list[str]]:
        rewards, errors = {}, []
        for name, instance_id in self.instances.items():
            tool = self.tools[name]
            try:
                rewards[name] = float(await tool.calc_reward(instance_id))
            except Exception as error:
                errors.append(f"{name}.calc_reward: {error!r}")
            try:
                await tool.release(instance_id)
            except Exception as error:
                errors.append(f"{name}.release: {error!r}")
        return rewards, errors


def call_outcome(future: Future, timeout: float) -> tuple[str, bool]:
    """(text for the model, whether the call failed) of a call that finished or reached its time limit."""
    if not future.done():
        return f"Error when executing tool: no answer within {timeout:g} s (multi_turn.tool_timeout)", True
    error = future.exception()
    if error is not None:
        return f"Error when executing tool: {error}", True
    return future.result(), False
