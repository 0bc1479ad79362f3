"""The Megatron engine under each 2-GPU parallel layout against one process at TP = PP = 1, on the same HF weights.

Each layout runs in processes of its own (megatron-core's parallel state is one layout per process), launched with
torchrun on `megatron_parallel_worker.py`: log-probs of `make_batch`'s 8 samples, one update on the gradient-revealing
optimizer (lr·g/(|g|+1), so updated log-probs compare gradients), log-probs again. Each layout must give the one-GPU
run's log-probs before and after the update, its loss and its gradient norm (the one-GPU run is launched once):
- TP = 2: attention heads, MLP and the tied vocabulary split over two ranks, log-probs through the
  vocabulary-parallel reductions of `megatron/log_probs.py`. This run also saves the checkpoint of the last test.
- TP = 2 with sequence parallel, under a token budget (`use_dynamic_bsz`): activations between the tensor-parallel
  regions sharded along the sequence, whose length is that of each micro-batch trimmed to the columns its samples
  use: 12, 10, 9 and 9, so odd lengths too (the engine pads them to even). Without Transformer Engine the engine
  turns sequence parallelism off with a warning, and this is a second TP = 2 run.
- PP = 2: two decoder layers per stage; log-probs come from the last stage, and the tied embedding's gradient is
  summed over the first and the last stage.
- PP = 2 with virtual pipeline 2: four model chunks of one layer each on the interleaved schedule.
- DP = 2 (TP = PP = 1 on two ranks): each rank computes its half of the batch; megatron-core's gradient averaging
  must give the one-process update (the loss-scaling contract of `engines/base.py`).
- (CP > 1 is refused at load: the engine does not split sequences over context-parallel ranks yet.)
- EP = 2 on a tiny Qwen2-MoE (4 experts, a gated shared expert), against its own one-GPU run: two experts per rank,
  tokens sent to them by megatron-core's all-to-all dispatcher; the dense layers are data-parallel (DP = 2). Every
  token goes to all 4 experts (weighted by the router's probabilities): with top 2 of 4, bf16 rounding flips a near
  tie of the router in about one token per layer (seen against fp32 on this model), which moves log-probs by more
  than the tolerance whatever the engine does.
- a checkpoint saved at TP = 2 is refused at TP = 1 (the optimizer state reshards over data-parallel ranks only).

Tolerance: every run computes in bf16 over fp32 master weights, so log-probs agree to bf16 rounding, 0.05 nats (the
tolerance of test_megatron_engine_gpu.py), before and after the update; the update itself moves them by over 10 times
that. (On CPU, this model's bf16 and fp32 log-probs differ by 0.012 before the update and 0.016 after it.) The tiny
models are initialised at std 0.07, not the default 0.02, so that log-probs depend on every layer by much more than
the tolerance: at 0.02 they are nearly uniform, and a wrongly loaded layer moves them by less than 0.05.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration.fsdp_engine_worker import make_batch
from integration.two_ranks import worker_environment
from transformers import AutoModelForCausalLM

from ember.engines.base import MicroBatchSpec
from ember.engines.batching import micro_batches
from ember.engines.megatron.bridge import transformer_engine_available
from ember.models.tiny import tiny_model_config

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices: each layout runs on two ranks, one GPU each")]

WORKER = Path(__file__).with_name("megatron_parallel_worker.py")
TOLERANCE = 0.05
INIT_STD = 0.07
TOKEN_BUDGET = 24  # tokens per micro-batch: make_batch's 8 samples in micro-batches 12, 10, 9 and 9 columns wide
LAUNCH_TIMEOUT_S = 180  # one launch takes 20-40 s; a hung collective would otherwise wait NCCL's 10 minutes
MASK = make_batch(samples=8).response_mask.bool()  # the worker's batch


def launch(model_dir: str, out_file: Path, processes: int, *options: str) -> dict:
    """torchrun the worker on `processes` GPUs; returns what its rank 0 wrote."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKER), model_dir, str(out_file), *options]
    subprocess.run(command, check=True, env=worker_environment(), timeout=LAUNCH_TIMEOUT_S)
    return torch.load(out_file)


def assert_same_update(got: dict, expected: dict) -> None:
    """Log-probs before and after the update, the update's loss and gradient norm: equal to bf16 rounding. (The
    gradient is clipped to norm 1, so the updated log-probs would not see a wrong gradient scale; its norm does.)"""
    torch.testing.assert_close(got["before"][MASK], expected["before"][MASK], atol=TOLERANCE, rtol=0)
    assert got["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], abs=TOLERANCE)
    assert got["metrics"]["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=0.05)
    assert (got["after"][MASK] - got["before"][MASK]).abs().max() > 10 * TOLERANCE  # the update moved them
    torch.testing.assert_close(got["after"][MASK], expected["after"][MASK], atol=TOLERANCE, rtol=0)


def save_tiny_model(arch: str, out_dir: Path, **overrides) -> str:
    """A tiny `arch` model (vocab 128, hidden 64, 4 heads, 2 KV heads) at init std INIT_STD, as fp32 HF weights."""
    config = tiny_model_config(arch, vocab_size=128, initializer_range=INIT_STD, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return str(out_dir)


def micro_batch_widths(max_token_len: int) -> list[int]:
    """The columns of each micro-batch the worker's batch is cut into under a token budget (on one rank)."""
    spec = MicroBatchSpec(max_token_len=max_token_len)
    micros, _ = micro_batches(make_batch(samples=8), spec, all_reduce=lambda tensor, op: tensor)
    return [micro.input_ids.shape[1] for micro in micros]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 of 4 layers with a tied head."""
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("model"), num_hidden_layers=4, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def one_gpu(model_dir, tmp_path_factory) -> dict:
    """The reference: TP = PP = 1 in one process."""
    return launch(model_dir, tmp_path_factory.mktemp("one_gpu") / "result.pt", 1)


@pytest.fixture(scope="module")
def tensor_parallel(model_dir, tmp_path_factory) -> tuple[dict, str]:
    """TP = 2 without sequence parallel, saving a checkpoint after its update: (its result, the checkpoint)."""
    out_dir = tmp_path_factory.mktemp("tp2")
    checkpoint = str(out_dir / "checkpoint")
    result = launch(model_dir, out_dir / "result.pt", 2, "--tp", "2", "--no-sequence-parallel", "--save", checkpoint)
    return result, checkpoint


def test_tensor_parallel_matches_one_gpu(tensor_parallel, one_gpu):
    assert_same_update(tensor_parallel[0], one_gpu)


def test_tensor_parallel_with_sequence_parallel_and_odd_lengths_matches_one_gpu(model_dir, one_gpu, tmp_path):
    assert micro_batch_widths(TOKEN_BUDGET) == [12, 10, 9, 9]  # odd lengths, which two ranks cannot halve
    result = launch(model_dir, tmp_path / "result.pt", 2, "--tp", "2", "--sequence-parallel",
                    "--max-token-len", str(TOKEN_BUDGET))
    # without Transformer Engine the engine turns it off (the local spec's norm has no sequence-parallel form)
    assert result["sequence_parallel"] == transformer_engine_available()
    assert_same_update(result, one_gpu)


@pytest.mark.parametrize("layout", [["--pp", "2"], ["--pp", "2", "--vpp", "2"], []], ids=["pp2", "pp2_vpp2", "dp2"])
def test_pipeline_and_data_parallel_layouts_match_one_gpu(model_dir, one_gpu, tmp_path, layout):
    assert_same_update(launch(model_dir, tmp_path / "result.pt", 2, *layout), one_gpu)


def test_expert_parallel_matches_one_gpu(tmp_path):
    moe_model_dir = save_tiny_model("qwen2_moe", tmp_path / "model", num_experts_per_tok=4)
    one_gpu = launch(moe_model_dir, tmp_path / "one_gpu.pt", 1)
    assert_same_update(launch(moe_model_dir, tmp_path / "ep2.pt", 2, "--ep", "2"), one_gpu)


def test_a_checkpoint_saved_at_tp2_is_refused_at_tp1(model_dir, tensor_parallel, tmp_path):
    """The optimizer state (`dp_reshardable`) reshards over data-parallel ranks only: a resume under other
    tensor-parallel sizes stops naming them (tests/integration/test_megatron_parallel_cpu.py checks the
    data-parallel resharding)."""
    _, checkpoint = tensor_parallel
    with pytest.raises(subprocess.CalledProcessError):
        launch(model_dir, tmp_path / "result.pt", 1, "--load", checkpoint)
