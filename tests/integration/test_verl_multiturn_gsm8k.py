"""verl's multi-turn GSM8K tool example runs with ember's command: `--config-path` holds only verl's files
(tests/verl_multiturn_configs/: the example's config, which composes verl's `ppo_trainer` defaults, and its tool
config), the overrides are those of verl's run script (examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh)
with paths and sizes swapped for a tiny model on CPU, and the parquet is in the exact format of verl's
examples/data_preprocess/gsm8k_multiturn_w_tool.py.

The tiny random model never writes a tool call, so each sample's first turn is forced to submit "72" to verl's
`calc_gsm8k_reward` tool (as in test_rl_multi_turn.py); the rest is real. The reward (an override appended to the
script's, as its `$@` allows) returns the tool's own `calc_reward`, so a sample's score shows that the tool read
its ground truth from the row's `extra_info.tools_kwargs` and that its reward reached the sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ember.cli import main as ember_main
from forced_tool_call import call_tokens, force_first_turn
from ember.data.parquet import write_parquet

CONFIGS = Path(__file__).resolve().parents[1] / "verl_multiturn_configs"
CALL = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
QUESTIONS = [("Natalia sold 48 clips in April and half as many in May. How many clips did she sell?", "72"),
             ("Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?", "10")]
TOOL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return extra_info["tool_rewards"]["calc_gsm8k_reward"]
'''


def gsm8k_multiturn_row(question_raw: str, solution: str, split: str, index: int) -> dict:
    """One row as verl's gsm8k_multiturn_w_tool.py `process_fn` builds it (the `answer` column's text made up:
    the script keeps GSM8K's worked answer, whose last line is `#### <solution>`)."""
    question = question_raw + " " + "Let's think step by step and output the final answer after `####`."
    answer_raw = f"The worked solution.\n#### {solution}"
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system",
             "content": ("You are a math expert. You are given a question and you need to solve it step by step. "
                         "Reasoning step by step before any tool call. "
                         "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
                         "before generate final answer at least once and refine your answer if necessary. "
                         "Put your final answer in the format of `#### <answer>`.")},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split, "index": index, "answer": answer_raw, "question": question_raw,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }


def verl_script_overrides(model: Path, train: Path, test: Path, tool_config: Path) -> list[str]:
    """The run script's overrides in its order; model, data and tool paths swapped, and the sizes of a
    3B model on 8 GPUs (batch, lengths, n, micro-batches, GPUs) swapped for a tiny model on CPU."""
    return [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=1024",
        "data.max_response_length=160", "data.filter_overlong_prompts=True", "data.truncation='error'",
        "data.return_raw_chat=True", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "global_profiler.tool=torch_memory", "global_profiler.save_path=./mem_snapshots",
        "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
        "global_profiler.global_tool_config.torch_memory.stack_depth=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85", "actor_rollout_ref.rollout.multi_stage_wake_up=True",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.rollout.over_sample_rate=0.1",
        "actor_rollout_ref.rollout.mode=async", "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
        "trainer.logger=[\"console\"]", "trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang'",
        "trainer.experiment_name=qwen2.5-3b_baseline", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=-1", "trainer.test_freq=20", "trainer.val_before_train=True",
        f"data.train_files={train}", f"data.val_files={test}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}", "trainer.total_epochs=15"]


@pytest.fixture
def forced_call(monkeypatch):
    return force_first_turn(monkeypatch)


def test_verls_gsm8k_tool_example_runs_with_embers_command(inputs, tmp_path, forced_call, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(inputs.model_dir)
    forced_call += call_tokens(tokenizer, CALL)
    rows = {split: [gsm8k_multiturn_row(question, solution, split, index)
                    for index, (question, solution) in enumerate(QUESTIONS)] for split in ("train", "test")}
    train, test = (write_parquet(rows[split], tmp_path / f"{split}.parquet") for split in ("train", "test"))
    reward = tmp_path / "tool_reward.py"
    reward.write_text(TOOL_REWARD)
    monkeypatch.chdir(tmp_path)  # the script's relative paths (./mem_snapshots) land here
    overrides = verl_script_overrides(inputs.model_dir, train, test,
                                      CONFIGS / "tool_config" / "gsm8k_tool_config.yaml")
    run_dir = tmp_path / "run"
    added = [f"custom_reward_function.path={reward}", f"trainer.default_local_dir={run_dir}",
             "trainer.total_training_steps=2", "trainer.val_before_train=False",
             f"trainer.rollout_data_dir={tmp_path / 'rollouts'}"]
    assert ember_main(["train", "--config-path", str(CONFIGS), "--config-name", "gsm8k_multiturn_grpo",
                       *overrides, *added]) == 0

    assert not list(tmp_path.glob("mem_snapshots/**/*.pickle"))  # torch_memory on CPU: nothing to record
    records = {record["step"]: record for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "actor/pg_loss" in record}
    assert sorted(records) == [1, 2]
    for record in records.values():
        assert record["agent/tool_calls"] == 8 and record["agent/tool_errors"] == 0  # 2 prompts × 4 samples, 1 call each
        assert record["agent/tool_turns/mean"] == 1 and record["actor/pg_loss"] == record["actor/pg_loss"]
    for step in (1, 2):
        samples = [json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(samples) == 8 and all(sample["output"].startswith(CALL) for sample in samples)
        # the tool scored "72" against each row's own ground truth (extra_info.tools_kwargs), and that reached the score
        assert sorted((sample["gts"], sample["score"]) for sample in samples) == [("10", 0.0)] * 4 + [("72", 1.0)] * 4
