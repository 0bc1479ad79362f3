"""A multi-turn GRPO run with tools, as `ember train` runs it (rollout.multi_turn on ember's engine, a tiny model
on CPU), stopped after a checkpoint and resumed from it.

The tiny random model never writes a tool call, so its first turn is forced (a scripted policy): the engine's
step is wrapped to replace each first turn's sampled tokens by a Hermes call of the code runner. Everything
after that is real: the tool runs in its subprocess, its turn is appended as tokens, the model's second turn
is sampled, and the trainer computes log-probs over exactly these tokens with the tool turn masked out."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ember.cli import main as ember_main
from forced_tool_call import call_tokens, force_first_turn
from rl_helpers import run_overrides

TOOLS = """\
tools:
  - class_name: ember.agent.tools.python_code.PythonCodeTool
    config: {timeout: 5, isolate_network: false}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: Runs Python code and returns what it prints.
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config: {}
    tool_schema:
      type: function
      function: {name: calc_gsm8k_reward, description: checks an answer, parameters: {type: object}}
"""
CALL = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2 + 3)"}}</tool_call>'


@pytest.fixture
def forced_call(monkeypatch):
    return force_first_turn(monkeypatch)


def test_a_multi_turn_grpo_run_with_tools_trains_and_resumes(inputs, tmp_path, forced_call):
    tokenizer = AutoTokenizer.from_pretrained(inputs.model_dir)
    forced_call += call_tokens(tokenizer, CALL)
    tool_config = tmp_path / "tools.yaml"
    tool_config.write_text(TOOLS)
    run_dir = tmp_path / "run"
    overrides = run_overrides(
        inputs, run_dir, "actor_rollout_ref.rollout.name=ember", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}", "data.max_response_length=128",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.save_freq=1",
        "trainer.logger=['console']", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")

    def step_records():
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {record["step"]: record for record in map(json.loads, lines) if "actor/pg_loss" in record}

    assert ember_main(["train", *overrides, "trainer.total_training_steps=1"]) == 0
    assert ember_main(["train", *overrides, "trainer.total_training_steps=2", "trainer.resume_mode=auto"]) == 0

    records = step_records()
    assert sorted(records) == [1, 2]  # step 1 from the first run, step 2 after resuming from its checkpoint
    for record in records.values():
        assert record["agent/tool_calls"] == 8 and record["agent/tool_errors"] == 0  # 2 prompts × 4 samples, 1 call each
        assert record["agent/assistant_turns/mean"] == 2 and record["agent/tool_turns/mean"] == 1
        assert record["agent/tool_tokens/mean"] > 0 and record["agent/model_tokens/mean"] > len(forced_call)
        assert record["actor/pg_loss"] == record["actor/pg_loss"]  # finite, not NaN
    outputs = [json.loads(line)["output"] for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(outputs) == 8 and all(output.startswith(CALL + "\ntool\n5\n\nassistant\n") for output in outputs)
