"""The tools ember ships and the tool config YAML: verl's gsm8k tool config loads unchanged; the Python runner
kills code at its time limit, caps memory, passes no proxies and (where the kernel allows) no network;
config mistakes name the file, the entry and what to change."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import torch

from ember.agent import load_tools
from ember.agent.tools.gsm8k import Gsm8kTool
from ember.agent.tools.python_code import PythonCodeTool
from ember.config.errors import ConfigError
from ember.data.batch import Batch

VERL_GSM8K_TOOLS = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
CODE_SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "runs Python",
                                                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def test_verls_gsm8k_tool_config_loads_and_scores_like_verls_tool(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_GSM8K_TOOLS)
    (tool,) = load_tools(str(path)).values()
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"

    async def session():
        instance = await tool.create(None, ground_truth="72")
        wrong = await tool.execute(instance, {"answer": "71"})
        right = await tool.execute(instance, {"answer": "72"})
        again = await tool.execute(instance, {"answer": "72"})
        reward = await tool.calc_reward(instance)
        await tool.release(instance)
        return wrong, right, again, reward, instance

    wrong, right, again, reward, instance = asyncio.run(session())
    assert (wrong[0].text, wrong[1]) == ("Current parsed answer='71' reward=0.0", -0.05)  # no improvement
    assert (right[0].text, right[1]) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert again[1] == -0.05 and reward == 1.0 and instance not in tool.instances


@pytest.mark.parametrize("text, message", [
    ("tools: []\n", "expected a non-empty list under 'tools:'"),
    ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    tool_schema: {function: {name: s}}\n",
     "class_name=verl.tools.search_tool.SearchTool is verl's and ember has no version of it"),
    ("tools:\n  - class_name: ember.agent.tools.gsm8k.Gsm8kTool\n    tool_schema: {type: function}\n",
     r"tools\[0\]: tool_schema needs function.name"),
    ("tools:\n  - class_name: no.such.Tool\n    tool_schema: {function: {name: s}}\n",
     "class_name=no.such.Tool cannot be imported"),
    ("tools:\n  - class_name: collections.OrderedDict\n    tool_schema: {function: {name: s}}\n",
     "lacks create, execute, calc_reward, release"),
])
def test_a_bad_tool_config_names_what_to_change(tmp_path, text, message):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_tools(str(path))
    with pytest.raises(ConfigError, match="multi_turn.tool_config_path=.*missing.yaml: no such file"):
        load_tools(str(tmp_path / "missing.yaml"))


def network_isolation_available() -> bool:
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


def test_the_code_runner_answers_and_enforces_its_limits():
    tool = PythonCodeTool({"timeout": 1, "memory_mb": 256, "isolate_network": False}, CODE_SCHEMA)

    def execute(code: str):
        return asyncio.run(tool.execute("x", {"code": code}))

    assert execute("print(6 * 7)")[0].text == "42\n"
    assert execute("import os; print(sorted(os.environ))")[0].text == "['HOME', 'LANG', 'PATH']\n"  # no proxies
    failed = execute("raise ValueError('bad input')")[0].text  # an exception is an answer, not a tool failure
    assert "ValueError: bad input" in failed and failed.endswith("(exit code 1)")
    assert "MemoryError" in execute("block = bytearray(1 << 30)")[0].text
    with pytest.raises(TimeoutError, match="time limit of 1 s and was killed"):
        execute("import time; time.sleep(30)")


@pytest.mark.skipif(not network_isolation_available(), reason="this kernel refuses unprivileged network namespaces")
def test_the_code_runner_has_no_network():
    tool = PythonCodeTool({"timeout": 5}, CODE_SCHEMA)
    text = asyncio.run(tool.execute("x", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)"}))[0].text
    assert "Network is unreachable" in text


def test_a_multi_turn_batch_attends_every_turn_and_counts_only_the_models_tokens():
    eos = 9
    batch = Batch.from_rollout([[1, 2]], [[5, eos, 7, 7, 6, eos]], pad_token_id=0, eos_token_ids=[eos],
                               response_masks=[[1, 1, 0, 0, 1, 1]], response_length=8)
    assert batch.attention_mask[0, 2:].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]  # past the first EOS: tool turn, turn 2
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    single = Batch.from_rollout([[1, 2]], [[5, eos, 7]], pad_token_id=0, eos_token_ids=[eos])
    assert single.response_mask[0].tolist() == single.attention_mask[0, 2:].tolist() == [1, 1, 0]
    assert torch.equal(batch.position_ids[0, :8], torch.arange(8))


def test_the_calculator_evaluates_arithmetic_and_nothing_else(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class_name: ember.agent.tools.calculator.CalculatorTool\n    config: {}\n"
                      "    tool_schema:\n      type: function\n      function:\n        name: calculator\n"
                      "        parameters: {type: object, properties: {expression: {type: string}}}\n")
    (tool,) = load_tools(str(config)).values()

    def answer(expression):
        response, reward, _ = asyncio.run(tool.execute("i", {"expression": expression}))
        return response.text

    assert answer("347 * 586") == "203342" and answer("-(2 + 3) ** 2 / 5") == "-5" and answer("7 / 2") == "3.5"
    assert answer("__import__('os').system('true')").startswith("Error: only numbers")
    assert answer("(1).__class__").startswith("Error: only numbers")
    assert answer("9 ** 9 ** 9").startswith("Error: exponent")
    assert answer("1 / 0").startswith("Error") and answer("2 +").startswith("Error")
    assert asyncio.run(tool.execute("i", {}))[0].text.startswith("Error: give")
