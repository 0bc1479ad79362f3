"""Packed sequences (`use_remove_padding`) in the Megatron engine against its padded micro-batches, on the same
weights, fp32 on a CPU through megatron-core's own GPTModel behind megatron_on_cpu's stand-ins
(megatron_packed_worker.py): left-padded prompts and right-padded responses of different lengths become one THD row
per micro-batch (RoPE restarting per sequence, attention kept inside each sequence by ember's core attention), and
the outputs come back to [b, R]. Log-probs and entropy (fused head at TP = 1), critic values, NLA reconstructor
predictions and NLA-injected log-probs equal the padded ones to 1e-5, before and after one update whose loss,
grad norm and updated weights agree as closely; fixed-size and token-budget micro-batches alike. Measured: at most
2.4e-6 (entropy), weights 1.5e-8. (TP 2 and PP 2 with packing: test_megatron_parallel_cpu.py.)"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_engine_worker import make_batch, make_model_dir

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

WORKER = Path(__file__).with_name("megatron_packed_worker.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("megatron-packed")
    model_dir = make_model_dir("qwen2", str(directory / "model"))  # tied head, 4 query and 2 key-value heads
    subprocess.run([sys.executable, str(WORKER), model_dir, str(directory / "results.pt")], check=True, timeout=300)
    return torch.load(directory / "results.pt")


def assert_same_outputs(got: dict, expected: dict, mask: torch.Tensor) -> None:
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.shape == expected[name].shape, name
        if value.shape == mask.shape:  # per-token outputs: packed runs leave zeros outside the response
            value, reference = value[mask], expected[name][mask]
        else:
            reference = expected[name]
        torch.testing.assert_close(value, reference, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["actor", "critic", "reconstructor", "injection"])
def test_packed_outputs_and_one_update_equal_the_padded_ones(results, case):
    variants = dict(results[case])
    padded = variants.pop("padded")
    assert padded["packed_rows"] == 0
    mask = make_batch(samples=8).response_mask.bool()
    moved = max((padded["after"][name] - padded["before"][name]).abs().max() for name in padded["before"])
    assert moved > 0.01  # the update moved the outputs, so equal updates are a check
    for name, packed in variants.items():
        assert packed["packed_rows"] > 0, name  # it ran packed
        assert_same_outputs(packed["before"], padded["before"], mask)
        assert packed["metrics"]["loss"] == pytest.approx(padded["metrics"]["loss"], abs=TOLERANCE)
        assert packed["metrics"]["grad_norm"] == pytest.approx(padded["metrics"]["grad_norm"], rel=TOLERANCE)
        assert_same_outputs(packed["after"], padded["after"], mask)
        for weight, tensor in padded.get("weights", {}).items():
            torch.testing.assert_close(packed["weights"][weight], tensor, atol=TOLERANCE, rtol=0, msg=weight)
        if case == "injection":  # the vectors reached the packed forward
            assert (packed["plain"]["log_probs"] - packed["before"]["log_probs"])[mask].abs().max() > 0.1
