"""`ember export` on checkpoints written by `ember sft`: the exported folder loads in transformers
with the checkpoint's weights, and a folder that is no checkpoint of either command is refused."""

from pathlib import Path

import pytest
import torch
from fixtures import make_tiny_model_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ember.cli import main
from ember.config import ConfigError
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_rows, sft_row_from_rl_row
from ember.trainer.export import export_checkpoint


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A 2-step SFT run of a tiny model checkpointing after each step (the last one is also its final export)."""
    root = tmp_path_factory.mktemp("sft-export")
    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 8, seed=0)]
    model_dir, run_dir = make_tiny_model_dir(root), root / "run"
    assert main(["sft", "data.multiturn.enable=true", f"data.train_files={write_parquet(rows, root / 'train.parquet')}",
                 "data.max_length=64", f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}",
                 "trainer.logger=[console]", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
                 "optim.lr=1e-2", "optim.warmup_steps_ratio=0", "trainer.total_training_steps=2",
                 "trainer.save_freq=1"]) == 0
    return model_dir, run_dir


def weights(directory):
    return load_file(str(directory / "model.safetensors"))


def test_export_of_an_sft_checkpoint_loads_in_transformers_with_its_weights(sft_run, tmp_path, capsys):
    model_dir, run_dir = sft_run
    out_dir = tmp_path / "step2"
    capsys.readouterr()
    assert main(["export", str(run_dir / "global_step_2"), str(out_dir)]) == 0
    assert capsys.readouterr().out == f"{run_dir / 'global_step_2'} exported (Hugging Face format): {out_dir}\n"

    # The last checkpoint holds the weights the run exported itself at its end.
    exported, final, initial = weights(out_dir), weights(run_dir / "hf_model"), weights(model_dir)
    assert exported.keys() == final.keys() == initial.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)
    assert any(not torch.equal(exported[name], initial[name]) for name in initial)  # trained, not the base model
    assert (out_dir / "tokenizer.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", dtype=torch.float32).eval()
    input_ids = torch.tensor([[5, 17, 3, 42, 8, 11]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reference(input_ids).logits)

    # An earlier checkpoint is an earlier policy.
    earlier = weights(Path(export_checkpoint(str(run_dir / "global_step_1"), str(tmp_path / "step1"))))
    assert any(not torch.equal(earlier[name], final[name]) for name in final)


def test_a_folder_that_is_not_a_checkpoint_is_refused(sft_run, tmp_path, capsys):
    _, run_dir = sft_run
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 2  # the run folder, not one of its steps
    assert "has no actor/ folder; pass a global_step_N folder written by ember train or ember sft" in capsys.readouterr().err

    # A global_step_N folder whose run configuration is neither an RL nor an SFT run's.
    stray = tmp_path / "stray"
    (stray / "global_step_1" / "actor").mkdir(parents=True)
    (stray / "config.yaml").write_text("data: {train_files: x.parquet}\n")
    with pytest.raises(ConfigError, match="is the configuration of neither an ember train run"):
        export_checkpoint(str(stray / "global_step_1"), str(tmp_path / "out"))
