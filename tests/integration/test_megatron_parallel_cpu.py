"""The Megatron engine under each 2-rank layout against one process, on a CPU (gloo, megatron_on_cpu's
stand-ins): tests/gpu/test_megatron_parallel_gpu.py's worker and comparison, in fp32, so the layouts must agree to
rounding (1e-5), not to bf16's 0.05. Each layout runs megatron-core's own collectives: tensor-parallel
all-reduces and the vocabulary-parallel log-probs (TP 2), pipeline sends and receives with variable shapes (PP 2),
the interleaved schedule (PP 2 × virtual 2) and gradient reduction over data-parallel ranks (DP 2). (Expert
parallelism stays on the GPU file: megatron-core's MoE path reaches Transformer Engine and CUDA kernels the
stand-ins do not cover.) Packed rows (`use_remove_padding`) at TP 2 and at PP 2 with token budgets give the padded
one-process update too. A checkpoint saved at DP 2 resumes at DP 1 with the same next update; one saved
at TP 2 is refused at TP 1, naming the sizes (the optimizer state reshards over data-parallel ranks only)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import make_tiny_model_dir
from fsdp_engine_worker import make_batch
from two_ranks import worker_environment

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

WORKER = Path(__file__).with_name("megatron_layout_parity_worker.py")
TOLERANCE = 1e-5
SAMPLES = 8  # the worker's batch: make_batch(samples=8)


def launch(model_dir: str, out_file: Path, processes: int, *options: str, check: bool = True):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKER), model_dir, str(out_file), "--param-dtype", "float32", *options]
    result = subprocess.run(command, env=worker_environment(), timeout=300, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return torch.load(out_file)
    return result


def assert_same_update(got: dict, expected: dict) -> None:
    """The same log-probs (of response tokens: a packed run leaves zeros elsewhere) before and after one update."""
    mask = make_batch(samples=SAMPLES).response_mask.bool()
    for key in ("before", "after"):
        torch.testing.assert_close(got[key][mask], expected[key][mask], atol=TOLERANCE, rtol=0, msg=key)
    assert got["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], abs=TOLERANCE)
    assert got["metrics"]["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=TOLERANCE)
    assert (got["after"] - got["before"]).abs().max() > 0.1  # the update moved the log-probs


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Qwen2 of 4 layers and its one-process run (TP = PP = 1)."""
    directory = tmp_path_factory.mktemp("dense")
    model_dir = str(make_tiny_model_dir(directory, "qwen2", num_hidden_layers=4))
    return model_dir, launch(model_dir, directory / "one.pt", 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2", "--no-sequence-parallel"], ["--pp", "2"], ["--pp", "2", "--vpp", "2"],
                                    [], ["--tp", "2", "--no-sequence-parallel", "--packed"],
                                    ["--pp", "2", "--packed", "--max-token-len", "20"]],
                         ids=["tp2", "pp2", "pp2_vpp2", "dp2", "tp2_packed", "pp2_packed_budget"])
def test_each_layout_gives_the_one_process_update(dense, tmp_path, layout):
    model_dir, one = dense
    assert_same_update(launch(model_dir, tmp_path / "two.pt", 2, *layout), one)


@pytest.mark.slow
def test_a_checkpoint_reshards_over_data_parallel_ranks_and_refuses_other_model_parallel_sizes(dense, tmp_path):
    model_dir, _ = dense
    # bf16, as runs train (the fp32 load is test_megatron_resume.py's)
    saved = launch(model_dir, tmp_path / "dp2.pt", 2, "--param-dtype", "bfloat16", "--save", str(tmp_path / "dp2"))
    resumed = launch(model_dir, tmp_path / "dp1.pt", 1, "--param-dtype", "bfloat16", "--load", str(tmp_path / "dp2"))
    torch.testing.assert_close(resumed["before"], saved["after"], atol=0, rtol=0)
    assert (resumed["metrics"]["loss"], resumed["metrics"]["grad_norm"]) == pytest.approx(
        (saved["next_metrics"]["loss"], saved["next_metrics"]["grad_norm"]), rel=1e-3)
    torch.testing.assert_close(resumed["after"], saved["next_after"], atol=0.02, rtol=0)

    # A checkpoint of another tensor-parallel size: the saved one with the layout its engine records set to TP=2
    # (what a TP=2 run writes there; the engine refuses by that record before reading any shard).
    schedule = tmp_path / "dp2" / "lr_schedule.json"
    recorded = json.loads(schedule.read_text())
    assert recorded["layout"]["tensor_model_parallel_size"] == 1
    recorded["layout"]["tensor_model_parallel_size"] = 2
    shutil.copytree(tmp_path / "dp2", tmp_path / "tp2")
    (tmp_path / "tp2" / "lr_schedule.json").write_text(json.dumps(recorded))
    refused = launch(model_dir, tmp_path / "tp1.pt", 1, "--param-dtype", "bfloat16", "--load", str(tmp_path / "tp2"),
                     check=False)
    assert refused.returncode != 0
    assert "was saved with tensor_model_parallel_size=2 (now 1)" in refused.stdout + refused.stderr
