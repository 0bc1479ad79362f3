"""A Megatron engine loaded from a checkpoint makes the very update the saved engine makes next (actor and
critic), on a CPU through megatron_on_cpu's stand-ins: megatron-core's own DDP, distributed optimizer and
dist_checkpointing. Three updates before the save, so Adam's step count, moments and master weights all differ
from a fresh optimizer's (a step count left at the loading template's 1 once made every resumed update wrong)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

WORKER = Path(__file__).with_name("megatron_resume_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])  # float32: the optimizer's state is its parameters
def test_a_loaded_megatron_engine_makes_the_saved_engines_next_update(tmp_path, param_dtype):
    out_file = tmp_path / "results.pt"
    subprocess.run([sys.executable, str(WORKER), str(out_file), param_dtype], check=True, timeout=600)
    results = torch.load(out_file)
    for role in ("actor", "critic"):
        result = results[role]
        assert result["loaded_diff"] == 0.0, role
        assert result["loaded_adam_steps"] == [3.0], role
        assert result["next_resumed"] == result["next"], role
        assert result["after_diff"] == 0.0, role  # Adam's bias correction needs the step count
