"""Dynamic batch size on CPU with tiny models: token-budget micro-batches give the same
log-probs (in the original sample order), the same loss and the same update as fixed-size
ones for every loss aggregation, also on 2 gloo ranks that need different numbers of
micro-batches, and an RL run with `use_dynamic_bsz` trains end to end.

Run as `python -m torch.distributed.run --nproc_per_node 2 test_dynamic_batch.py MODEL_DIR OUT_DIR`
this file is the 2-rank worker.
"""

from __future__ import annotations

import os
import sys

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
from two_ranks import run_two_ranks, worker_environment

from ember.algorithms import LOSS_AGG_MODES, ClipConfig
from ember.distributed.device import shutdown_distributed
from ember.engines.base import MicroBatchSpec
from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.micro_batches import min_micro_batch_count, plan_micro_batches
from ember.workers.actor import Actor, ActorOptions
from rl_helpers import all_finite, metrics_by_step, run_overrides, train

SAMPLES = 8
BUDGET = 20  # tokens per micro-batch: several micro-batches, samples regrouped out of order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir("qwen2", str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def batch():
    return make_batch(seed=3, samples=SAMPLES)


def test_the_budget_regroups_the_samples(batch):
    groups = plan_micro_batches(batch.attention_mask.sum(dim=1).tolist(), BUDGET)
    assert 1 < len(groups) < SAMPLES
    assert any(group != list(range(group[0], group[0] + len(group))) for group in groups)  # not consecutive


def test_forward_outputs_come_back_in_the_original_order(model_dir, batch):
    engine = FSDPEngine(engine_options(model_dir))
    whole = engine.forward(batch, SAMPLES, compute_entropy=True)
    dynamic = engine.forward(batch, MicroBatchSpec(max_token_len=BUDGET), compute_entropy=True)
    mask = batch.response_mask.bool()
    assert dynamic.log_probs.shape == (SAMPLES, batch.response_length)
    torch.testing.assert_close(dynamic.log_probs[mask], whole.log_probs[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(dynamic.entropy[mask], whole.entropy[mask], atol=1e-6, rtol=0)


def make_actor(model_dir: str, loss_agg_mode: str, micro_batch: MicroBatchSpec) -> Actor:
    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    return Actor(engine, ActorOptions(
        mini_batch_samples=SAMPLES, micro_batch=micro_batch, log_prob_micro_batch=micro_batch, ppo_epochs=1,
        shuffle=False, policy_loss="vanilla", clip=ClipConfig(clip_ratio=0.2), loss_agg_mode=loss_agg_mode,
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", temperature=1.0,
        norm_length=8, seed=0))


def with_rl_fields(batch, log_probs):
    """Advantages, old and reference log-probs that differ per token (so clipping and KL are active)."""
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(log_probs.shape, generator=generator)
    mask = batch.response_mask
    return batch.with_fields(advantages=torch.randn(log_probs.shape, generator=generator) * mask,
                             old_log_probs=(log_probs + 0.3 * noise) * mask, ref_log_probs=(log_probs - 0.2) * mask)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_dynamic_micro_batches_give_the_same_loss_and_update(model_dir, batch, loss_agg_mode):
    log_probs = FSDPEngine(engine_options(model_dir)).forward(batch, SAMPLES).log_probs
    rl_batch = with_rl_fields(batch, log_probs)
    results = {}
    for name, spec in (("fixed", MicroBatchSpec(size=2)), ("dynamic", MicroBatchSpec(max_token_len=BUDGET))):
        actor = make_actor(model_dir, loss_agg_mode, spec)
        metrics = actor.update(rl_batch, step=0)
        results[name] = metrics, full_weights(actor.engine)
    (fixed_metrics, fixed_weights), (dynamic_metrics, dynamic_weights) = results["fixed"], results["dynamic"]
    assert dynamic_metrics["actor/loss"] == pytest.approx(fixed_metrics["actor/loss"], rel=1e-6, abs=1e-6)  # float32 sums in another order
    assert dynamic_metrics["actor/grad_norm"] == pytest.approx(fixed_metrics["actor/grad_norm"], rel=1e-5)
    for name, weight in fixed_weights.items():
        torch.testing.assert_close(dynamic_weights[name], weight, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(fixed_weights["model.layers.0.mlp.up_proj.weight"],
                           full_weights(FSDPEngine(engine_options(model_dir)))["model.layers.0.mlp.up_proj.weight"])


def test_rl_run_with_dynamic_batch_size(inputs, tmp_path):
    """Two PPO steps (critic, reference for the KL loss) with every role on token budgets."""
    run_dir = tmp_path / "run"
    trainer = train(run_overrides(
        inputs, run_dir, "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
        "actor_rollout_ref.actor.ppo_epochs=2", "critic.ppo_max_token_len_per_gpu=48"))
    parts = trainer.parts
    assert parts.actor.in_process().options.micro_batch == MicroBatchSpec(max_token_len=64)
    assert parts.actor.in_process().options.log_prob_micro_batch == MicroBatchSpec(max_token_len=64)
    assert parts.reference.in_process().micro_batch == MicroBatchSpec(max_token_len=64)
    assert parts.critic.in_process().options.micro_batch == MicroBatchSpec(max_token_len=48)
    assert parts.critic.in_process().options.forward_micro_batch == MicroBatchSpec(max_token_len=48)
    metrics = metrics_by_step(run_dir)
    assert trainer.step == 2 and {1, 2} <= set(metrics)
    for step in (1, 2):
        assert all_finite(metrics[step][key] for key in ("actor/loss", "actor/grad_norm", "critic/vf_loss"))
        assert metrics[step]["actor/grad_norm"] > 0 and metrics[step]["critic/grad_norm"] > 0


def rank_halves(batch):
    """The 4 shortest samples for rank 0 and the 4 longest for rank 1 (they need different counts)."""
    order = batch.attention_mask.sum(dim=1).argsort(stable=True).tolist()
    return batch.select(order[:SAMPLES // 2]), batch.select(order[SAMPLES // 2:])


@pytest.mark.slow
def test_two_ranks_with_different_micro_batch_counts_match_one_process(model_dir, batch, tmp_path):
    halves = rank_halves(batch)
    counts = [min_micro_batch_count(half.attention_mask.sum(dim=1).tolist(), BUDGET) for half in halves]
    assert counts[0] < counts[1]  # rank 0 must run extra micro-batches to keep in step
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rl_helpers imports tests/fixtures.py
    environment = worker_environment(PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    run_two_ranks(__file__, model_dir, str(tmp_path), timeout=120, environment=environment)
    result = torch.load(tmp_path / "result.pt")

    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    joined = halves[0].concat(halves)
    expected_log_probs = engine.forward(joined, SAMPLES).log_probs
    metrics = engine.train_mini_batch(joined, mean_log_prob_loss, SAMPLES)
    mask = joined.response_mask.bool()
    torch.testing.assert_close(result["log_probs"][mask], expected_log_probs[mask], atol=1e-6, rtol=0)
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    for name, weight in full_weights(engine).items():
        torch.testing.assert_close(result["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def run_rank(model_dir: str, out_dir: str) -> None:
    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
    rank = torch.distributed.get_rank()
    local = rank_halves(make_batch(seed=3, samples=SAMPLES))[rank]
    spec = MicroBatchSpec(max_token_len=BUDGET)
    log_probs = engine.forward(local, spec).log_probs
    gathered = [torch.zeros_like(log_probs) for _ in range(2)]
    torch.distributed.all_gather(gathered, log_probs)
    metrics = engine.train_mini_batch(local, mean_log_prob_loss, spec)
    weights = full_weights(engine)
    if rank == 0:
        torch.save({"log_probs": torch.cat(gathered), "metrics": metrics, "weights": weights},
                   os.path.join(out_dir, "result.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    run_rank(*sys.argv[1:])
