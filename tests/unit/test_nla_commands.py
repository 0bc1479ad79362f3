"""`ember nla train / sft / extract / eval`: the configured-command grammar, the checks a run makes first, the stops."""

import logging
from pathlib import Path

import pytest
import yaml
from fixtures import make_nla_model_dir, nla_rl_row

from ember.cli import main
from ember.config import load_config
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.parquet import write_parquet
from ember.nla.checks import nla_run_notes

RUNS = str(Path(__file__).resolve().parents[1] / "nla_configs")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_nla_model_dir(tmp_path_factory.mktemp("nla-commands"))


def tiny_run(tmp_path, model_dir, layer=1):
    """Overrides that point the fork's 7B FSDP2 file at a tiny model and data on one device."""
    train = write_parquet([nla_rl_row([0.1] * 64, activation_layer=layer)] * 4, tmp_path / "rl_train_layer1.parquet")
    return [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}", "critic.output_layer_index=1",
            f"data.train_files=[{train}]", "data.val_files=null", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
            "trainer.rollout_data_dir=null", "nla_eval.enabled=false", f"trainer.default_local_dir={tmp_path}/ckpt",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=32"]


def nla(command, *arguments):
    return main(["nla", command, "--config-path", RUNS, *arguments])


def test_help_lists_the_four_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nla", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert all(command in text for command in ("train", "sft", "extract", "eval"))
    with pytest.raises(SystemExit):
        main(["nla", "train", "--help"])
    assert "--print-config" in capsys.readouterr().out


def test_print_config_of_each_command(capsys):
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo_megatron", "--print-config") == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 64
    assert printed["trainer"]["mini_batch_counts"] == "prompts" and printed["critic"]["output_layer_index"] == 20
    assert printed["actor_rollout_ref"]["nla"] == printed["nla"]
    assert nla("sft", "--config-name", "nla_sft_7b_8gpu", "nla.train_mode=critic", "--print-config") == 0
    assert yaml.safe_load(capsys.readouterr().out)["nla"]["train_mode"] == "critic"
    assert nla("extract", "--config-name", "runs/qwen_7b/rl_train", "--print-config") == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["layer_index"] == 20
    assert main(["nla", "train", "--print-config", "trainer.logger=[console]"]) == 0  # no file: ember's nla_grpo_full
    assert yaml.safe_load(capsys.readouterr().out)["actor_rollout_ref"]["rollout"]["name"] == "nla_sglang"


def test_describe_lists_the_nla_keys(capsys):
    assert main(["nla", "train", "--describe", "nla.injection"]) == 0
    text = capsys.readouterr().out
    assert "nla.injection.mode = 'replace'" in text and "nla.injection.position = 'manual'" in text


def test_user_errors_exit_2_with_the_message(capsys):
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo_megatron", "critic.megatron.pipeline_model_parallel_size=2") == 2
    assert capsys.readouterr().err.splitlines()[0] == ("error: NLA Megatron critic does not support pipeline parallelism "
                                                       "(PP=2); set pipeline_model_parallel_size: 1")
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo", "nla.injection.modes=add") == 2
    assert "unknown key nla.injection.modes" in capsys.readouterr().err


def test_train_on_megatron_takes_the_fork_file_as_written_and_stops_only_at_the_cpu(tmp_path, model_dir, capsys,
                                                                                   caplog):
    with caplog.at_level(logging.WARNING):
        assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo_megatron", *tiny_run(tmp_path, model_dir),
                   "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                   "critic.megatron.tensor_model_parallel_size=2") == 2  # the tiny model has 2 key-value heads
    # the file's override_transformer_config (params_dtype: bfloat16, DDP fields, selective recompute with a
    # layer count) reached megatron-core, which built and loaded the model; training it needs a GPU
    assert "strategy megatron trains on GPUs only" in capsys.readouterr().err
    assert "rollout.name=nla_sglang: ember generates with its own engine" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    (["critic.output_layer_index=5"], "critic.output_layer_index=5 is outside the model: {model} has 2 decoder layers, "
                                      "so hidden_states indices run 0..2"),
    (["critic.output_layer_index=0"], "critic.output_layer_index reads hidden_states[0], the embeddings' output, which "
                                      "ember cannot train a critic on"),
    (["critic.output_layer_index=-1"], "data.train_files holds vectors of layer 1 (their activation_layer column), but "
                                       "critic.output_layer_index predicts hidden_states[2]"),
    (["critic.model.truncate_at_layer=3", "critic.output_layer_index=1"], "critic.model.truncate_at_layer=3 is outside the "
                                                                          "model: {model} has 2 decoder layers"),
    (["critic.critic_prompt='" + "7" * 129 + "'"], "critic.critic_prompt is 129 tokens long; the critic takes at most 128"),
    (["data.train_files=[missing.parquet]"], "data.train_files: file not found: missing.parquet"),
])
def test_train_start_checks_name_the_key(tmp_path, model_dir, capsys, overrides, message):
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo", *tiny_run(tmp_path, model_dir), *overrides) == 2
    assert message.format(model=model_dir) in capsys.readouterr().err


def test_train_stops_on_data_written_for_another_marker(tmp_path, model_dir, capsys):
    from ember.nla.marker import Marker, marker_metadata

    other = write_parquet([nla_rl_row([0.1] * 64)], tmp_path / "other.parquet", metadata=marker_metadata(Marker("㊗", 9)))
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo", *tiny_run(tmp_path, model_dir),
               f"data.val_files=[{other}]") == 2
    assert f"{other} was written with marker '㊗' (token id 9)" in capsys.readouterr().err


def test_sft_checks_the_critic_layer_then_the_data(tmp_path, model_dir, capsys):
    train = write_parquet([{**nla_rl_row([0.1] * 64), "response": "a fox"}], tmp_path / "sft_layer1.parquet")
    run = [f"model.partial_pretrain={model_dir}", f"data.train_files={train}", "data.val_files=null",
           "trainer.n_gpus_per_node=1", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}/ckpt",
           "data.train_batch_size=32", "nla.critic.model_path=null", "trainer.device=auto"]
    assert nla("sft", "--config-name", "nla_sft_7b_8gpu", *run, "nla.train_mode=critic") == 2
    assert "nla.critic.output_layer_index=20 is outside the model" in capsys.readouterr().err
    assert nla("sft", "--config-name", "nla_sft_7b_8gpu", *run, "nla.train_mode=critic", "nla.critic.output_layer_index=1") == 2
    assert "fewer than one batch of 32" in capsys.readouterr().err


def test_eval_checks_its_files_then_stops_at_its_row(tmp_path, model_dir, capsys):
    run = tiny_run(tmp_path, model_dir)
    assert nla("eval", "--config-name", "runs/qwen_7b/rl_grpo", *run) == 2  # the file's eval sets do not exist here
    assert "nla_eval.eval_files.QA: file not found" in capsys.readouterr().err
    eval_set = write_parquet([{"source_prompt": "x", "activation_vector": [0.1] * 64, "expected_completions": ["y"]}],
                             tmp_path / "eval.parquet")
    assert nla("eval", "--config-name", "runs/qwen_7b/rl_grpo_megatron", *run, "trainer.n_gpus_per_node=8",
               "~nla_eval.eval_files", f"nla_eval.eval_file={eval_set}", "nla.injection.mode=project") == 2
    err = capsys.readouterr().err
    assert "nla.injection.mode=project" in err and "megatron" not in err


def test_notes_on_keys_that_mean_something_else_in_ember():
    cfg = load_config(["engine_kwargs.sglang={attention_chunk_size: 0}"], config_name="nla_grpo_full", schema=NLATrainConfig)
    notes = nla_run_notes(cfg)
    assert len(notes) == 2 and "ember generates with its own engine" in notes[0]
    assert notes[1].startswith("engine_kwargs.sglang: SGLang's arguments do not apply to ember's engine")
    assert len(nla_run_notes(load_config(["actor_rollout_ref.rollout.name=ember"], config_name="nla_grpo_full",
                                         schema=NLATrainConfig))) == 0


def test_a_critic_of_another_hidden_size_and_a_layer_a_cut_critic_lacks_are_named(tmp_path, model_dir, capsys):
    from ember.nla.checks import check_kept_layer
    from ember.config import ConfigError

    other = make_nla_model_dir(tmp_path / "other", hidden_size=32)
    assert nla("train", "--config-name", "runs/qwen_7b/rl_grpo", *tiny_run(tmp_path, model_dir),
               f"critic.model.path={other}") == 2
    assert "the critic's hidden size is 32" in capsys.readouterr().err
    check_kept_layer("critic.output_layer_index", 2, 2, 2, "m")
    with pytest.raises(ConfigError, match="keeps only its first 1 of 2 decoder layers"):
        check_kept_layer("critic.output_layer_index", 2, 2, 1, "m")
