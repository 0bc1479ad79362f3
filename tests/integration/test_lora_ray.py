"""LoRA with the roles in Ray workers (CPU, gloo), as users run it on GPUs: a GRPO run with the KL loss
(the reference is the actor's engine with the adapter off, in the actor's processes) on two
data-parallel ranks equals the same run on one rank, on every metric of both steps and the adapter its
checkpoint exports. Generation (ember's engine, seeded by each sample's place in the batch) draws the
same tokens at both sizes, so step 2's metrics also hold the adapted-layers-only sync to the rollout
engine of each rank.

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
             "trainer.device=cpu", "trainer.total_training_steps=2", "trainer.save_freq=2",
             f"{A}.actor.loss_agg_mode=seq-mean-token-mean", "trainer.val_before_train=False", "trainer.test_freq=-1"]
NOT_COMPARED = (*NOT_REPRODUCIBLE, "batch/balance_")


def run(inputs, run_dir, ranks: int) -> tuple[dict, dict]:
    trainer = train(run_overrides(inputs, run_dir, *LORA_GRPO, f"trainer.n_gpus_per_node={ranks}"), use_ray=True)
    assert trainer.parts.actor.dp_size == ranks and trainer.parts.reference.group is trainer.parts.actor.group
    adapter = export_checkpoint(str(run_dir / "global_step_2"), str(run_dir / "adapter"))
    return metrics_by_step(run_dir), load_file(f"{adapter}/adapter_model.safetensors")


def test_grpo_with_lora_and_kl_loss_on_two_ray_ranks_equals_one_rank(inputs, tmp_path, local_ray):
    expected_metrics, expected_adapter = run(inputs, tmp_path / "one", 1)
    metrics, adapter = run(inputs, tmp_path / "two", 2)
    assert metrics[2]["actor/kl_loss"] > 0  # the adapter moved the policy away from the reference
    for step in (1, 2):
        compared = [key for key in expected_metrics[step] if not key.startswith(NOT_COMPARED)]
        assert "actor/grad_norm" in compared and "actor/kl_loss" in compared
        for key in compared:
            assert metrics[step][key] == pytest.approx(expected_metrics[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert adapter.keys() == expected_adapter.keys() and len(adapter) == 2 * 7 * 2
    for name, tensor in expected_adapter.items():
        torch.testing.assert_close(adapter[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_a_rollout_pool_of_its_own_is_sent_only_the_adapted_layers_after_the_first_sync(inputs, tmp_path, local_ray):
    common = [*LORA_GRPO, "trainer.total_training_steps=3", "trainer.save_freq=-1"]
    train(run_overrides(inputs, tmp_path / "hybrid", *common))
    train(run_overrides(inputs, tmp_path / "split", *common, "actor_rollout_ref.hybrid_engine=false",
                        "rollout.n_gpus_per_node=1"))
    hybrid, split = metrics_by_step(tmp_path / "hybrid"), metrics_by_step(tmp_path / "split")
    for step in (1, 2, 3):  # the rollout's own pool generated with the same merged weights
        compared = [key for key in hybrid[step] if not key.startswith(NOT_COMPARED)]
        assert "actor/kl_loss" in compared and "critic/score/mean" in compared
        assert {key: split[step][key] for key in compared} == {key: hybrid[step][key] for key in compared}, step
    base = hf_weights(inputs.model_dir)
    every = sum(tensor.numel() for tensor in base.values())
    adapted = sum(tensor.numel() for name, tensor in base.items() if name.endswith("proj.weight"))
    sent = [split[step]["perf/weight_sync_gb"] * 2**30 for step in (1, 2, 3)]
    assert sent[1] == sent[2] == pytest.approx(sent[0] * adapted / every, rel=1e-6)
