"""The `ember` command: help texts, --print-config, error exits and dispatch to the subcommands."""

import importlib.util
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import yaml
from fixtures import corrupt_parquet, make_tiny_model_dir, rl_row

from ember.cli import main
from ember.data.parquet import write_parquet


def fake_module(monkeypatch, name, **functions):
    module = types.ModuleType(name)
    for attribute, function in functions.items():
        setattr(module, attribute, function)
    monkeypatch.setitem(sys.modules, name, module)


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for command in ("train", "sft", "preprocess", "export"):
        assert command in text


@pytest.mark.parametrize("command", ["train", "sft"])
def test_train_and_sft_help_explain_overrides_and_print_config(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--config-path", "--config-name", "--print-config", "+key=value", "~key", "--describe"):
        assert needle in text


def test_export_help(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "CKPT_DIR" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("ember.data.preprocess.command") is None, reason="preprocess recipes not landed")
def test_preprocess_help_is_the_recipes_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["preprocess", "--help"])
    assert exit_.value.code == 0
    assert "ember preprocess" in capsys.readouterr().out


def test_unknown_key_exits_2_with_suggestion_through_python_m_ember():
    result = subprocess.run([sys.executable, "-m", "ember", "train", "actor_rollout_ref.actor.ppo_mini_batch=16", "--print-config"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: unknown key actor_rollout_ref.actor.ppo_mini_batch; did you mean ppo_mini_batch_size")


@pytest.mark.parametrize("module", ["ember", "ember.cli"])
def test_python_m_runs_the_command(module):
    result = subprocess.run([sys.executable, "-m", module, "nla", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: ember nla")


def test_bad_value_exits_2(capsys):
    assert main(["train", "data.train_batch_size=abc", "--print-config"]) == 2
    assert "error: invalid value for data.train_batch_size: 'abc' (expected an integer)" in capsys.readouterr().err


def test_overrides_may_surround_options(capsys):
    assert main(["train", "actor_rollout_ref.rollout.n=4", "--print-config", "actor_rollout_ref.rollout.n=8", "trainer.nnodes=1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor_rollout_ref"]["rollout"]["n"] == 8


def test_unknown_option_is_an_argparse_error():
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--print-confg"])
    assert exit_.value.code == 2


def test_print_config_runs_nothing_and_skips_the_feature_check(monkeypatch, capsys):
    fake_module(monkeypatch, "ember.trainer.rl", run_rl=lambda cfg: pytest.fail("--print-config must not train"))
    assert main(["train", "actor_rollout_ref.actor.strategy=megatron", "--print-config"]) == 0
    assert "strategy: megatron" in capsys.readouterr().out


def test_real_run_refuses_an_unimplemented_switch_before_training(monkeypatch, capsys):
    fake_module(monkeypatch, "ember.trainer.rl", run_rl=lambda cfg: pytest.fail("must not train"))
    assert main(["train", "actor_rollout_ref.actor.strategy=megatron", "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true"]) == 2
    assert capsys.readouterr().err == ("error: actor_rollout_ref.actor.megatron.use_dist_checkpointing=true (initial "
                                       "weights from a Megatron checkpoint) is not implemented yet; start from the HF "
                                       "model (ember converts it with mbridge)\n")


def test_train_without_a_model_or_data_runs_the_builtin_demo_with_the_users_overrides_on_top(monkeypatch):
    received = []
    fake_module(monkeypatch, "ember.trainer.builtin", run_builtin=lambda cfg: received.append(cfg) or 0)
    fake_module(monkeypatch, "ember.trainer.rl", run_rl=lambda cfg: pytest.fail("the demo, not a plain run"))
    assert main(["train", "actor_rollout_ref.rollout.n=4"]) == 0
    (cfg,) = received
    assert cfg.trainer.experiment_name == "builtin-arithmetic" and cfg.actor_rollout_ref.rollout.n == 4


def test_an_empty_config_file_is_an_error_not_the_builtin_demo(monkeypatch, tmp_path, capsys):
    fake_module(monkeypatch, "ember.trainer.builtin", run_builtin=lambda cfg: pytest.fail("an empty file ran the demo"))
    (tmp_path / "run.yaml").write_text("")
    assert main(["train", "--config-path", str(tmp_path), "--config-name", "run"]) == 2
    assert capsys.readouterr().err.startswith("error: --config-name run sets neither actor_rollout_ref.model.path nor "
                                              "data.train_files (is the file empty?)")


def test_train_passes_the_loaded_config_to_run_rl(monkeypatch, tmp_path):
    received = []
    fake_module(monkeypatch, "ember.trainer.rl", run_rl=lambda cfg: received.append(cfg) or 0)
    (tmp_path / "runs").mkdir()
    # a model named: the run itself, not the built-in demo (whose warm start would train for minutes here)
    (tmp_path / "runs/grpo.yaml").write_text("algorithm: {adv_estimator: grpo}\n"
                                             "actor_rollout_ref: {model: {path: /models/qwen}}\n")
    assert main(["train", "--config-path", str(tmp_path), "--config-name", "runs/grpo", "actor_rollout_ref.rollout.n=4"]) == 0
    (cfg,) = received
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 4


@pytest.mark.parametrize("command", ["train", "sft"])
def test_ctrl_c_during_start_up_is_a_clean_stop(command, monkeypatch, capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt

    fake_module(monkeypatch, f"ember.trainer.{'rl' if command == 'train' else 'sft'}",
                **{"run_rl" if command == "train" else "run_sft": interrupted})
    assert main([command, "actor_rollout_ref.model.path=/models/qwen" if command == "train"
                 else "optim.lr=2e-5"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("stopped by Ctrl-C") and "Traceback" not in err


def test_sft_passes_the_loaded_config_to_run_sft(monkeypatch):
    received = []
    fake_module(monkeypatch, "ember.trainer.sft", run_sft=lambda cfg: received.append(cfg) or 3)
    assert main(["sft", "optim.lr=2e-5", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2"]) == 3  # its exit status
    assert received[0].optim.lr == 2e-5


def test_export_calls_export_checkpoint(monkeypatch):
    calls = []
    fake_module(monkeypatch, "ember.trainer.export",
                export_checkpoint=lambda ckpt, out, merged: calls.append((ckpt, out, merged)))
    assert main(["export", "/ckpt/step_10", "/out/hf"]) == 0
    assert main(["export", "/ckpt/step_10", "/out/merged", "--merged"]) == 0  # a LoRA run's adapter merged
    assert calls == [("/ckpt/step_10", "/out/hf", False), ("/ckpt/step_10", "/out/merged", True)]


def test_preprocess_hands_its_arguments_to_the_recipe_parser(monkeypatch):
    def build_parser(parser):
        parser.add_argument("recipe")
        parser.add_argument("--out")

    fake_module(monkeypatch, "ember.data.preprocess.command", build_parser=build_parser, run=lambda args: 0 if args.out == "x" else 1)
    assert main(["preprocess", "gsm8k", "--out", "x"]) == 0
    assert main(["preprocess", "gsm8k", "--out", "y"]) == 1


def test_describe_lists_keys_with_descriptions(capsys):
    assert main(["train", "--describe", "actor_rollout_ref.rollout.n"]) == 0
    assert capsys.readouterr().out == "actor_rollout_ref.rollout.n = 1  # responses sampled per prompt (the group size of GRPO)\n"
    assert main(["sft", "--describe", "nope"]) == 2


# --- errors in what the user gave: exit 2, one message naming the key or path, no traceback -----------------


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    reward = root / "reward.py"
    reward.write_text("def score(solution_str, ground_truth):\n    return 1.0\n\n\n"
                      "def helper(text):\n    return text\n")
    (root / "empty_folder").mkdir()
    return SimpleNamespace(model=make_tiny_model_dir(root), reward=reward, empty=root / "empty_folder",
                           train=write_parquet([rl_row(f"{i} + 1", str(i + 1)) for i in range(8)], root / "train.parquet"))


def train_exit(capsys, inputs, run_dir, *overrides):
    """`ember train` on the tiny inputs with `overrides` after them: (status, stderr)."""
    status = main(["train", f"actor_rollout_ref.model.path={inputs.model}", f"data.train_files={inputs.train}",
                   "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                   f"trainer.default_local_dir={run_dir}", *overrides])
    return status, capsys.readouterr().err


TRAIN_ERRORS = {
    "model_folder_without_config": (["actor_rollout_ref.model.path={empty}"],
                                    "actor_rollout_ref.model.path={empty} holds no config.json"),
    "model_path_is_a_file": (["actor_rollout_ref.model.path={reward}"],
                             "actor_rollout_ref.model.path={reward} is a file, not a folder"),
    "critic_folder_without_config": (["algorithm.adv_estimator=gae", "critic.model.path={empty}",
                                      "critic.ppo_mini_batch_size=4"], "critic.model.path={empty} holds no config.json"),
    "no_train_files": (["data.train_files=null"], "data.train_files is not set"),
    "output_folder_under_a_file": (["trainer.default_local_dir={reward}/run"],
                                   "trainer.default_local_dir={reward}/run cannot be created (Not a directory"),
    "output_folder_is_a_file": (["trainer.default_local_dir={reward}"],
                                "trainer.default_local_dir={reward} is a file, not a folder"),
    "rollout_dump_folder_is_a_file": (["trainer.rollout_data_dir={reward}"],
                                      "trainer.rollout_data_dir={reward} is a file, not a folder"),
    "validation_dump_folder_under_a_file": (["trainer.validation_data_dir={reward}/dumps"],
                                            "trainer.validation_data_dir={reward}/dumps cannot be created"),
    "profiler_folder_is_a_file": (["global_profiler.tool=torch", "global_profiler.steps=[1]",
                                   "global_profiler.save_path={reward}"],
                                  "global_profiler.save_path={reward} is a file, not a folder"),
    "reward_function_not_in_its_file": (["custom_reward_function.path={reward}", "custom_reward_function.name=nope"],
                                        "no function 'nope' in {reward} (functions defined there: ['helper', 'score'])"),
    "required_section_removed": (["~actor_rollout_ref.actor"], "cannot remove actor_rollout_ref.actor: every run needs"),
    "megatron_sizes_the_model_cannot_split": (
        ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.rollout.name=ember", "trainer.n_gpus_per_node=8",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
         "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
         "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
        "invalid Megatron sizes:\n  - actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 does not divide "
        "the model's 2 key-value heads (grouped-query attention); sizes that do: 1, 2\n  - actor_rollout_ref.actor."
        "megatron.pipeline_model_parallel_size=2 × virtual_pipeline_model_parallel_size=2 = 4 stages do not divide the "
        "model's 2 decoder layers; stage counts that do: 1, 2"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_ERRORS))
def test_train_input_errors_exit_2_before_any_work(case, run_inputs, tmp_path, capsys):
    overrides, expected = TRAIN_ERRORS[case]
    paths = {"empty": run_inputs.empty, "reward": run_inputs.reward}
    status, err = train_exit(capsys, run_inputs, tmp_path / "run", *(item.format(**paths) for item in overrides))
    assert status == 2
    assert err.startswith("error: ") and expected.format(**paths) in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before the run began


def test_a_tensorboard_dir_in_the_environment_that_cannot_be_a_folder_exits_2(run_inputs, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(run_inputs.reward))
    status, err = train_exit(capsys, run_inputs, tmp_path / "run", "trainer.logger=['console','tensorboard']")
    assert status == 2 and err.startswith(f"error: TENSORBOARD_DIR (environment)={run_inputs.reward} is a file")
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_train_names_an_unreadable_parquet_file(key, run_inputs, tmp_path, capsys):
    broken = corrupt_parquet(write_parquet([rl_row(f"{i} + 2", str(i + 2)) for i in range(8)],
                                           tmp_path / "broken.parquet"), "truncated")
    status, err = train_exit(capsys, run_inputs, tmp_path / "run", f"{key}={broken}")
    assert status == 2 and err.startswith(f"error: {broken} cannot be read as parquet") and "Traceback" not in err


def test_export_of_a_missing_or_non_checkpoint_path_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint folder {tmp_path}/nowhere does not exist; pass a "
                                       "global_step_N folder written by ember train or ember sft\n")
    (tmp_path / "file").write_text("not a checkpoint")
    assert main(["export", str(tmp_path / "file"), str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path}/file is not a checkpoint: it has no actor/ folder" in capsys.readouterr().err


def test_export_onto_an_existing_file_exits_2_and_leaves_it(tmp_path, capsys):
    (tmp_path / "run" / "global_step_1" / "actor").mkdir(parents=True)
    (tmp_path / "model.bin").write_text("the user's file")
    assert main(["export", str(tmp_path / "run" / "global_step_1"), str(tmp_path / "model.bin")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}/model.bin is a file, not a folder")
    assert (tmp_path / "model.bin").read_text() == "the user's file"
