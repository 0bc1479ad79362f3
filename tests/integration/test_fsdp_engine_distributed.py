"""The FSDP2 engine on 2 gloo ranks (torchrun) against one process on the whole batch.

One update with each rank holding half of the mini-batch must give the weights one
process gives on the whole of it (the loss-scaling contract), and the 2-rank sharded
checkpoint must load into a 1-rank engine (DCP resharding).
"""

import os

import pytest
import torch
from fsdp_engine_worker import (
    GRADIENT_REVEALING_OPTIM,
    engine_options,
    full_weights,
    make_batch,
    make_model_dir,
    mean_log_prob_loss,
)
from two_ranks import run_two_ranks
from transformers import AutoModelForCausalLM

from ember.engines.fsdp.engine import FSDPEngine

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_engine_worker.py")


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    out_dir = tmp_path / "out"
    run_two_ranks(WORKER, model_dir, str(out_dir), timeout=120)
    result = torch.load(out_dir / "result.pt")

    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    batch = make_batch()
    expected_log_probs = engine.forward(batch, micro_batch_size=4).log_probs
    torch.testing.assert_close(result["log_probs"], expected_log_probs, atol=1e-6, rtol=0)
    metrics = engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=4)
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    expected_weights = full_weights(engine)
    assert result["weights"].keys() == expected_weights.keys()
    for name, weight in expected_weights.items():
        torch.testing.assert_close(result["weights"][name], weight, atol=1e-5, rtol=0, msg=name)

    resharded = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    resharded.load(str(out_dir / "checkpoint"))
    for name, weight in full_weights(resharded).items():
        assert torch.equal(weight, result["weights"][name]), name

    exported = dict(AutoModelForCausalLM.from_pretrained(str(out_dir / "hf")).named_parameters())
    for name, weight in result["weights"].items():
        assert torch.equal(exported[name].detach(), weight), name


@pytest.mark.slow
def test_weight_sync_gathers_uneven_shards_in_buckets():
    """The several-rank weight sync's one-collective-per-bucket gather equals DTensor's per-parameter one."""
    run_two_ranks(os.path.join(os.path.dirname(__file__), "fsdp_gather_worker.py"), timeout=120)
