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
    assert all(metrics[step]["actor/moe/max_over_mean_load"] >= 1.0 for step in (1, 2))  # the expert load, per step


def test_the_seeds_gsm8k_chat_run_on_a_tiny_qwen2_moe(tmp_path):
    """The MoE GRPO run users describe: chat-format GSM8K rows under `messages`, verl's gsm8k scorer with
    method flexible, GRPO n=4 with low_var_kl in the loss, the reference with param offload, token
    budgets and gradient checkpointing."""
    from ember.data.parquet import write_parquet
    from fixtures import make_tiny_model_dir

    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "messages": [{"role": "user", "content": f"What is {a} + {b}? Give the answer after ####."}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": a}}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (4, 4), (6, 1), (8, 1)]]
    train_file = write_parquet(rows, tmp_path / "train.parquet")
    model_dir = make_tiny_model_dir(tmp_path, "qwen2_moe")
    run_dir = tmp_path / "run"
    train([f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}",
           f"data.val_files={train_file}", "data.prompt_key=messages", "data.return_raw_chat=True",
           "+data.reward_fn._target_=ember.rewards.gsm8k.compute_score", "+data.reward_fn.method=flexible",
           "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=8",
           "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.name=ember",
           "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
           "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
           "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
           "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}", "trainer.logger=['console']",
           "reward_model.num_workers=0"])
    metrics = metrics_by_step(run_dir)
    for step in (1, 2):  # a random tiny model scores 0 on every answer: the run's plumbing is what is checked
        assert metrics[step]["reward/errors"] == 0 and "actor/kl_loss" in metrics[step]
        assert metrics[step]["actor/entropy"] > 0 and metrics[step]["actor/skipped"] == 0


class FixedRouter(torch.nn.Module):
    """A router that sends token t to experts (t % 3) and 3, as top-2 of 4."""

    top_k, num_experts = 2, 4

    def forward(self, hidden):
        tokens = hidden.reshape(-1, hidden.shape[-1]).shape[0]
        first = torch.arange(tokens) % 3
        indices = torch.stack([first, torch.full_like(first, 3)], dim=-1)
        return None, None, indices


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([FixedRouter(), FixedRouter()])

    def forward(self, hidden):
        for layer in self.layers:
            layer(hidden)


def test_expert_load_counts_real_tokens_by_hand():
    from ember.engines.expert_load import ExpertLoad, load_metrics

    load = ExpertLoad(TwoLayers())
    load.reset(torch.device("cpu"))
    mask = torch.tensor([True, True, True, True, False, False])  # tokens 0..3 real
    assert len(load.routers) == 2
    with load.recording(mask):
        for router in load.routers:
            router(torch.zeros(6, 8))
    # real tokens 0,1,2,3 -> first experts 0,1,2,0 and expert 3 for each: [2, 1, 1, 4] per layer
    assert load.counts.tolist() == [[2.0, 1.0, 1.0, 4.0], [2.0, 1.0, 1.0, 4.0]]
    metrics = load_metrics(load.counts)
    assert metrics["moe/tokens_per_expert_mean"] == 2.0 and metrics["moe/tokens_per_expert_max"] == 4.0
    assert metrics["moe/max_over_mean_load"] == 2.0 and metrics["moe/dropped_tokens"] == 0.0


@pytest.mark.parametrize("packed", [False, True])
def test_the_engine_reports_expert_load_of_every_real_token(tmp_path, packed):
    from ember.models.tiny import tiny_model_config

    model_dir = moe_model_dir(tmp_path, "qwen2_moe")
    config = tiny_model_config("qwen2_moe", vocab_size=128)
    batch = make_batch()
    engine = FSDPEngine(engine_options(model_dir, use_remove_padding=packed))
    metrics = engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    real_tokens = int(batch.attention_mask.sum())
    # each MoE layer routes every real token to top_k experts: mean load = tokens × top_k / experts
    expected_mean = real_tokens * config.num_experts_per_tok / config.num_experts
    assert metrics["moe/tokens_per_expert_mean"] == pytest.approx(expected_mean)
    assert metrics["moe/tokens_per_expert_max"] >= expected_mean and metrics["moe/max_over_mean_load"] >= 1.0


def test_output_router_logits_adds_the_routers_load_balancing_loss_to_the_actors(tmp_path):
    """`model.override_config.output_router_logits: true` (verl's key, HF's field) adds HF's load-balancing
    loss × `router_aux_loss_coef` to the actor's loss, as HF's CausalLM does when given labels."""
    model_dir = moe_model_dir(tmp_path, "qwen2_moe")
    batch = make_batch()
    plain = FSDPEngine(engine_options(model_dir))
    balanced = FSDPEngine(engine_options(model_dir, override_config={"output_router_logits": True,
                                                                    "router_aux_loss_coef": 0.5}))
    assert plain.router_aux_coef == 0 and balanced.router_aux_coef == 0.5
    without = plain.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=len(batch))
    with_aux = balanced.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=len(batch))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        expected = float(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids, output_router_logits=True).aux_loss)
    assert "moe/aux_loss" not in without and with_aux["moe/aux_loss"] == pytest.approx(expected, rel=1e-5)
    assert with_aux["loss"] - without["loss"] == pytest.approx(0.5 * expected, rel=1e-4)


def test_an_override_the_models_config_lacks_is_refused(tmp_path):
    from ember.config import ConfigError
    from ember.trainer.rl_setup import check_override_config

    model_dir = moe_model_dir(tmp_path, "qwen2_moe")
    check_override_config("actor_rollout_ref.model", model_dir, {"router_aux_loss_coef": 0.01})
    with pytest.raises(ConfigError, match="override_config sets router_aux_los_coef, which the model's config"):
        check_override_config("actor_rollout_ref.model", model_dir, {"router_aux_los_coef": 0.01})
