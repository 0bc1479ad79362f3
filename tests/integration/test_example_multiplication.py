"""The calculator example (`examples/smollm2_multiplication`) as a user runs it, on CPU with a tiny model in
place of SmolLM2: its data (three-digit products asked with the calculator prompt) load, its reward pays only
the answer the model marks, and `ember train` with its config runs a step whose tool calls reach the calculator
(the tiny model's first turn is forced to a call, `forced_tool_call.py`; the calculator's answer is real)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from ember.cli import main as ember_main
from fixtures import make_tiny_model_dir
from forced_tool_call import call_tokens, force_first_turn

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2_multiplication"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


def example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_pays_the_answer_the_model_marks_and_not_the_calculators():
    score = example_module("reward").compute_score
    assert score("ember/arithmetic/mul", "482 * 317 = 152794\n#### 152794", "152794") == 1.0
    assert score("ember/arithmetic/mul", "#### 152795", "152794") == 0.0
    called_and_stopped = f"{CALL}\ntool\n152794\n\nassistant\nThe product is 152794."
    assert score("ember/arithmetic/mul", called_and_stopped, "152794") == 0.0


def test_the_example_trains_with_its_config_data_tools_and_reward(tmp_path, monkeypatch):
    example_module("prepare").write_task(str(tmp_path), train_size=8, test_size=4)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert [message["role"] for message in rows[0]["prompt"]] == ["system", "user", "assistant", "tool", "assistant",
                                                                 "user"]
    assert rows[0]["prompt"][-1]["content"] == rows[0]["extra_info"]["question"]
    assert all(100 * 100 <= int(row["reward_model"]["ground_truth"]) <= 999 * 999 for row in rows)
    model_dir = make_tiny_model_dir(tmp_path, "qwen2")
    forced = force_first_turn(monkeypatch)
    forced += call_tokens(AutoTokenizer.from_pretrained(model_dir), CALL)
    monkeypatch.setenv("EMBER_DATA", str(tmp_path))
    monkeypatch.chdir(ROOT)  # the config names its tool and reward files from the repository's root
    run_dir = tmp_path / "run"
    assert ember_main(["train", "--config-path", str(EXAMPLE), "--config-name", "config",
                       f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
                       "trainer.device=cpu", "trainer.total_training_steps=1", "trainer.val_before_train=false",
                       "trainer.test_freq=-1", "trainer.logger=['console']", "data.train_batch_size=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                       "data.max_response_length=128"]) == 0
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if "actor/pg_loss" in line]
    assert record["agent/tool_calls"] == 4 and record["agent/tool_errors"] == 0  # 2 prompts × 2 samples, a call each
    assert record["critic/score/mean"] == 0.0  # the calculator said 42, the tiny model marked nothing
