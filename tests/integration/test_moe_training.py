"""MoE models (Qwen2-MoE with its shared expert, Qwen3-MoE) trained by the FSDP2 engine: the experts
run as grouped matmuls (transformers' grouped_mm, not a loop over experts), with the log-probs and
gradients of the per-expert loop, packed equal to padded, and a GRPO run through the trainer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember.engines.fsdp.engine import FSDPEngine
from fsdp_engine_worker import engine_options, make_batch, mean_log_prob_loss
from rl_helpers import metrics_by_step, prepare_inputs, run_overrides, train

MOE_ARCHS = ["qwen2_moe", "qwen3_moe"]


def moe_model_dir(tmp_path, arch: str) -> str:
    from ember.models.tiny import tiny_model_config

    config = tiny_model_config(arch, vocab_size=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / arch)
    return str(tmp_path / arch)


def reference_log_probs(model_dir: str, batch, experts: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=experts)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    return torch.log_softmax(logits[:, batch.response_prediction_positions].float(), -1).gather(
        -1, batch.responses.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_engine_runs_grouped_experts_with_the_per_expert_loops_log_probs(tmp_path, arch):
    model_dir = moe_model_dir(tmp_path, arch)
    batch = make_batch()
    engine = FSDPEngine(engine_options(model_dir))
    assert engine.module().config._experts_implementation == "grouped_mm"
    mask = batch.response_mask.bool()
    got = engine.forward(batch, micro_batch_size=2).log_probs
    torch.testing.assert_close(got[mask], reference_log_probs(model_dir, batch, "eager")[mask], rtol=1e-5, atol=1e-5)
    packed = FSDPEngine(engine_options(model_dir, use_remove_padding=True)).forward(batch, micro_batch_size=2).log_probs
    torch.testing.assert_close(packed[mask], got[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_grouped_experts_give_the_loops_gradients(tmp_path, arch):
    model_dir = moe_model_dir(tmp_path, arch)
    batch = make_batch()
    gradients = {}
    for experts in ("grouped_mm", "eager"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=experts)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
        log_probs = torch.log_softmax(logits[:, batch.response_prediction_positions].float(), -1).gather(
            -1, batch.responses.unsqueeze(-1)).squeeze(-1)
        (-(log_probs * batch.response_mask).sum()).backward()
        gradients[experts] = {name: parameter.grad.clone() for name, parameter in model.named_parameters()
                              if parameter.grad is not None}
    expert_weights = [name for name in gradients["eager"] if "experts" in name]
    assert expert_weights
    for name, gradient in gradients["eager"].items():
        torch.testing.assert_close(gradients["grouped_mm"][name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_grpo_trains_a_tiny_qwen2_moe(tmp_path):
    inputs = prepare_inputs(tmp_path / "inputs", arch="qwen2_moe")
    run_dir = tmp_path / "run"
    train(run_overrides(inputs, run_dir, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=ember",
                        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true"))
    metrics = metrics_by_step(run_dir)
    assert all(metrics[step]["actor/grad_norm"] > 0 for step in (1, 2))
