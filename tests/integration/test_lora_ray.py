"""LoRA with the roles in Ray workers (CPU, gloo), as users run it on GPUs: a GRPO run with the KL loss
(the reference is the actor's engine with the adapter off, in the actor's processes) in one process
against the same run on two data-parallel Ray ranks, and with the rollout on a pool of its own
(`hybrid_engine=false`). Generation (ember's engine, seeded by each sample's place in the batch) draws
the same tokens everywhere, so step 2's metrics also hold the weight sync after the first: only the
adapted layers, merged, to each rank's rollout engine or over the weight group to the rollout pool.

Loss metrics are means over each rank's micro-batches (as verl's), so the runs aggregate per sequence
(`seq-mean-token-mean`: equal shares of sequences make the mean of means the mean); the batch balance
metrics measure the split over ranks itself (1.0 on one rank) and are not compared."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import NOT_REPRODUCIBLE, hf_weights, metrics_by_step, run_overrides, train
from safetensors.torch import load_file

from ember.trainer.export import export_checkpoint

pytestmark = pytest.mark.slow
A = "actor_rollout_ref"
LORA_GRPO = [f"{A}.model.lora_rank=4", f"{A}.model.lora_alpha=8", f"{A}.actor.optim.lr=2e-2",
             f"{A}.actor.use_kl_loss=True", f"{A}.actor.kl_loss_coef=0.1", f"{A}.rollout.name=ember",
             f"{A}.actor.loss_agg_mode=seq-mean-token-mean", "trainer.device=cpu", "trainer.total_training_steps=2",
             "trainer.save_freq=2", "trainer.val_before_train=False", "trainer.test_freq=-1"]
NOT_COMPARED = (*NOT_REPRODUCIBLE, "batch/balance_")


def run(inputs, run_dir, *extra: str) -> tuple[dict, dict]:
    """The run's metrics by step and the adapter its step-2 checkpoint exports (PEFT's tensors); one device in
    this process, more (or a rollout pool of its own) in Ray workers."""
    trainer = train(run_overrides(inputs, run_dir, *LORA_GRPO, *extra))
    assert trainer.parts.reference.group is trainer.parts.actor.group
    adapter = export_checkpoint(str(run_dir / "global_step_2"), str(run_dir / "adapter"))
    return metrics_by_step(run_dir), load_file(f"{adapter}/adapter_model.safetensors")


def assert_same_run(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    (metrics, adapter), (expected_metrics, expected_adapter) = got, expected
    assert metrics[2]["actor/kl_loss"] > 0  # the adapter moved the policy away from the reference
    for step in (1, 2):
        compared = [key for key in expected_metrics[step] if not key.startswith(NOT_COMPARED)]
        assert "actor/grad_norm" in compared and "actor/kl_loss" in compared and "critic/score/mean" in compared
        for key in compared:
            assert metrics[step][key] == pytest.approx(expected_metrics[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert adapter.keys() == expected_adapter.keys() and len(adapter) == 2 * 7 * 2  # A and B of all-linear
    for name, tensor in expected_adapter.items():
        torch.testing.assert_close(adapter[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def one_rank(inputs, tmp_path_factory):
    return run(inputs, tmp_path_factory.mktemp("one-rank"), "trainer.n_gpus_per_node=1")


def test_grpo_with_lora_and_kl_loss_on_two_ray_ranks_equals_one_rank(inputs, tmp_path, one_rank, local_ray):
    assert_same_run(run(inputs, tmp_path, "trainer.n_gpus_per_node=2"), one_rank)


def test_a_rollout_pool_of_its_own_is_sent_only_the_adapted_layers_after_the_first_sync(inputs, tmp_path, one_rank, local_ray):
    got = run(inputs, tmp_path, "actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1")
    assert_same_run(got, one_rank)
    base = hf_weights(inputs.model_dir)
    every = sum(tensor.numel() for tensor in base.values())
    adapted = sum(tensor.numel() for name, tensor in base.items() if name.endswith("proj.weight"))
    sent = [got[0][step]["perf/weight_sync_gb"] * 2**30 for step in (1, 2)]
    assert sent[1] == pytest.approx(sent[0] * adapted / every, rel=1e-6)  # every weight, then the adapted ones
