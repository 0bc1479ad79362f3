"""A run folder (`trainer.default_local_dir`) keeps the work of the run in it (issue 30): a resume of another
model's checkpoints is refused before anything is written, a fresh run into a folder that holds another run's
checkpoints or metrics is refused unless `trainer.overwrite_default_local_dir`, and pruning deletes only the
run's own checkpoints (compared as step numbers, past step 10 too)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures import make_tiny_model_dir

from ember.cli import main as ember_main
from ember.trainer.checkpoint import list_checkpoints
from rl_helpers import build_trainer, close, logged_training_steps, run_overrides, train

TWO_STEPS = ("trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=False")


@pytest.fixture(scope="module")
def qwen2_run(inputs, tmp_path_factory) -> Path:
    """A finished 2-step run of the tiny Qwen2 model, a checkpoint per step (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("qwen2-run") / "run"
    train(run_overrides(inputs, run_dir, *TWO_STEPS))
    return run_dir


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory) -> Path:
    """A tiny Llama: the Qwen2 model's tensors, sizes and tokenizer, without its q/k/v biases."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def files_of(run_dir: Path) -> dict[str, bytes]:
    """Every file under `run_dir` with its bytes."""
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


def test_auto_resume_of_another_models_run_is_refused_and_the_folder_kept(inputs, qwen2_run, llama_model, tmp_path,
                                                                          capsys):
    run_dir = copy_of(qwen2_run, tmp_path)
    before = files_of(run_dir)
    llama = run_overrides(inputs, run_dir, "trainer.total_training_steps=3", "trainer.val_before_train=False",
                          f"actor_rollout_ref.model.path={llama_model}")
    assert ember_main(["train", *llama]) == 2
    error = capsys.readouterr().err
    assert f"trainer.default_local_dir={run_dir} holds a run of another model" in error, error
    assert f"{run_dir / 'global_step_2'}" in error and "LlamaForCausalLM" in error and "Qwen2ForCausalLM" in error
    assert "model.layers.0.self_attn.q_proj.bias" in error  # a tensor the checkpoint has and the model lacks
    assert "trainer.resume_mode=disable" in error and "trainer.overwrite_default_local_dir=true" in error
    assert files_of(run_dir) == before  # config.yaml, metrics, checkpoints and hf_model as the Qwen2 run left them

    # its checkpoints still export, with the config.yaml of the run that wrote them
    assert ember_main(["export", str(run_dir / "global_step_2"), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()

    # a checkpoint of another model named by resume_path is refused the same way, before anything is written
    elsewhere = tmp_path / "elsewhere"
    assert ember_main(["train", *llama, f"trainer.default_local_dir={elsewhere}", "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={run_dir / 'global_step_1'}"]) == 2
    error = capsys.readouterr().err
    assert f"trainer.resume_from_path={run_dir / 'global_step_1'} is a checkpoint of another model" in error
    assert "LlamaForCausalLM" in error
    assert not any(elsewhere.iterdir())


def test_a_fresh_run_into_another_runs_folder_is_refused_unless_told_to_overwrite(inputs, qwen2_run, tmp_path, capsys):
    run_dir = copy_of(qwen2_run, tmp_path)
    before = files_of(run_dir)
    fresh = run_overrides(inputs, run_dir, *TWO_STEPS, "trainer.resume_mode=disable",
                          "trainer.max_actor_ckpt_to_keep=1")
    assert ember_main(["train", *fresh]) == 2
    error = capsys.readouterr().err
    assert f"trainer.default_local_dir={run_dir} holds the checkpoints" in error, error
    assert "trainer.overwrite_default_local_dir=true" in error and "trainer.resume_mode=auto" in error
    assert files_of(run_dir) == before  # neither its metrics.jsonl nor config.yaml rewritten, no checkpoint pruned

    # told to overwrite: the old run's checkpoints and metrics go, and the new run keeps its own last checkpoint
    assert ember_main(["train", *fresh, "trainer.overwrite_default_local_dir=true"]) == 0
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]
    assert logged_training_steps(run_dir) == [1, 2]
    assert "max_actor_ckpt_to_keep: 1" in (run_dir / "config.yaml").read_text()


def test_auto_with_only_another_runs_metrics_is_refused(inputs, qwen2_run, tmp_path, capsys):
    run_dir = copy_of(qwen2_run, tmp_path)
    for _, path in list_checkpoints(str(run_dir)):
        shutil.rmtree(path)  # as a run that logged steps and died before its first checkpoint
    before = files_of(run_dir)
    assert ember_main(["train", *run_overrides(inputs, run_dir, *TWO_STEPS)]) == 2
    error = capsys.readouterr().err
    assert f"trainer.default_local_dir={run_dir} holds the metrics.jsonl" in error and "no checkpoint" in error, error
    assert files_of(run_dir) == before


def test_auto_resume_past_ten_checkpoints_takes_the_newest_and_prunes_by_step(inputs, tmp_path):
    run_dir = tmp_path / "run"
    common = ("trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=4", "trainer.val_before_train=False",
              "trainer.test_freq=-1")
    train(run_overrides(inputs, run_dir, *common, "trainer.total_training_steps=10"))
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [7, 8, 9, 10]

    trainer = build_trainer(run_overrides(inputs, run_dir, *common, "trainer.total_training_steps=11"))
    trainer.resume()
    close(trainer)
    assert trainer.step == 10  # global_step_10, not global_step_9 (the last by name)
    train(run_overrides(inputs, run_dir, *common, "trainer.total_training_steps=11"))
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [8, 9, 10, 11]
    assert logged_training_steps(run_dir) == list(range(1, 12))
