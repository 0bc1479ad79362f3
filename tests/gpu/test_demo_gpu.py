"""README's main command, `ember train` on its built-in default, on a GPU: the warm start, GRPO
and the export run where users first try them (CI runs the CPU path)."""

import json

import pytest

from ember.cli import main

pytestmark = pytest.mark.gpu


def test_the_built_in_demo_trains_and_exports_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}/run"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "actor/pg_loss" in line] == [1, 2]
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()
