"""Padding-free packing (`use_remove_padding`) and fused log-probs (`use_fused_kernels`) in the
FSDP2 engine, fp32 on CPU: the log-probs, entropy and critic values of a packed and/or fused
forward equal the padded, unfused ones for Llama, Qwen2, Qwen3 and a MoE model; one update
gives the same weights (so the same gradients, LM head and tied embedding included), with
fixed and token-budget micro-batches and on 2 gloo ranks; the RL loop and SFT run with the
switches on.
"""

from __future__ import annotations

import os

import pytest
import torch
from fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, engine_options, full_weights, make_model_dir
from packed_worker import SAMPLES, make_samples, train_once
from rl_helpers import all_finite, metrics_by_step, run_overrides, train
from two_ranks import run_two_ranks
from transformers import AutoModelForCausalLM

from ember.config import SFTConfig, load_config
from ember.data.batch import Batch
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.log_probs import compute_response_log_probs
from ember.data.packing import pack_batch

WORKER = os.path.join(os.path.dirname(__file__), "packed_worker.py")
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
SWITCHES = [dict(use_remove_padding=True), dict(use_fused_kernels=True),
            dict(use_remove_padding=True, use_fused_kernels=True)]
SWITCH_IDS = ["packed", "fused", "packed+fused"]
BUDGET = 20  # tokens per micro-batch: several micro-batches, samples regrouped out of order
TOLERANCE = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny fp32 models (vocab 128) by architecture; Qwen2's LM head is tied to its embedding."""
    root = tmp_path_factory.mktemp("packed-models")
    return {arch: make_model_dir(arch, str(root / arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def batch():
    return make_samples()


def masked(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    return values[batch.response_mask.bool()]


# --- forward ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_and_entropy_equal_the_padded_unfused_ones(model_dirs, batch, arch):
    options = dict(compute_entropy=True, temperature=0.7)
    expected = FSDPEngine(engine_options(model_dirs[arch])).forward(batch, 4, **options)
    for switches, name in zip(SWITCHES, SWITCH_IDS):
        engine = FSDPEngine(engine_options(model_dirs[arch], **switches))
        output = engine.forward(batch, 4, **options)
        assert output.log_probs.shape == expected.log_probs.shape
        torch.testing.assert_close(masked(output.log_probs, batch), masked(expected.log_probs, batch),
                                   **TOLERANCE, msg=name)
        torch.testing.assert_close(masked(output.entropy, batch), masked(expected.entropy, batch),
                                   **TOLERANCE, msg=name)
        with torch.no_grad():  # the LM head is itself again afterwards (generation uses the same module)
            logits = engine.module()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        assert logits.shape == (*batch.input_ids.shape, 128)


def test_fused_log_probs_refuse_a_model_that_rescales_its_logits(model_dirs, batch):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 does after its LM head
    with pytest.raises(ValueError, match="final_logit_softcapping.*use_fused_kernels=false"):
        compute_response_log_probs(model, batch, fused=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_values_equal_the_padded_ones(model_dirs, batch, arch):
    padded = FSDPEngine(engine_options(model_dirs[arch], role="critic")).forward(batch, 4).values
    packed = FSDPEngine(engine_options(model_dirs[arch], role="critic", use_remove_padding=True)).forward(batch, 4)
    torch.testing.assert_close(packed.values, padded, **TOLERANCE)
    assert masked(padded, batch).abs().min() > 0  # values exist where compared


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_attention_stays_within_each_sample(model_dirs, batch, attn_implementation):
    """Packed equals padded for each attention kernel, and the comparison is sharp enough to see
    attention crossing a sample boundary (the packed row under one plain causal mask)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    with torch.no_grad():
        padded, _ = compute_response_log_probs(model, batch)
        packed, _ = compute_response_log_probs(model, batch, packed=True)
        packing = pack_batch(batch)
        crossing = model(input_ids=packing.input_ids, attention_mask=torch.ones_like(packing.input_ids),
                         position_ids=packing.position_ids, logits_to_keep=packing.prediction_index).logits
        crossing = packing.unpack(torch.log_softmax(crossing[0], dim=-1).gather(1, packing.targets[:, None]))
    torch.testing.assert_close(masked(packed, batch), masked(padded, batch), **TOLERANCE)
    assert (masked(crossing, batch) - masked(padded, batch)).abs().max() > 1e-3


def test_fused_kernels_are_refused_for_a_critic(model_dirs):
    with pytest.raises(ValueError, match="set it for the actor and reference only"):
        EngineOptions(model_path=model_dirs["qwen2"], role="critic", use_fused_kernels=True)


# --- gradients --------------------------------------------------------------------------------------


def updated_weights(model_dir: str, batch: Batch, micro_batch, **switches) -> tuple[dict, dict]:
    """(metrics, full weights) after one update with the log-prob and entropy loss."""
    engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM, **switches))
    metrics = train_once(engine, batch, micro_batch)
    return metrics, full_weights(engine)


def assert_same_update(result: tuple[dict, dict], expected: tuple[dict, dict], model_dir: str) -> None:
    (metrics, weights), (expected_metrics, expected_weights) = result, expected
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    initial = full_weights(FSDPEngine(engine_options(model_dir)))
    for name, weight in expected_weights.items():
        torch.testing.assert_close(weights[name], weight, **TOLERANCE, msg=name)
        assert not torch.equal(weight, initial[name]), f"{name} did not move; the comparison would be empty"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied LM head
@pytest.mark.parametrize("switches", SWITCHES, ids=SWITCH_IDS)
def test_one_update_equals_the_padded_unfused_one(model_dirs, batch, arch, switches):
    expected = updated_weights(model_dirs[arch], batch, 4)
    assert_same_update(updated_weights(model_dirs[arch], batch, 4, **switches), expected, model_dirs[arch])


def value_loss(output: ModelOutput, batch: Batch, context: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Squared error against returns of 1 on every counted token: this micro-batch's share."""
    return ((output.values - 1.0) ** 2 * batch.response_mask).sum() / context.num_tokens, {}


def test_critic_update_equals_the_padded_one(model_dirs, batch):
    updates = []
    for packed in (False, True):
        engine = FSDPEngine(engine_options(model_dirs["qwen3"], role="critic", optim=GRADIENT_REVEALING_OPTIM,
                                           use_remove_padding=packed))
        updates.append((engine.train_mini_batch(batch, value_loss, 3), full_weights(engine)))
    assert updates[1][0]["loss"] == pytest.approx(updates[0][0]["loss"], abs=1e-6)
    for name, weight in updates[0][1].items():
        torch.testing.assert_close(updates[1][1][name], weight, **TOLERANCE, msg=name)


def test_token_budget_micro_batches_with_packing_and_fused_kernels(model_dirs, batch):
    """Dynamic batch size regroups and trims the samples; packed and fused on top, outputs and
    the update still equal those of fixed, padded micro-batches."""
    model_dir = model_dirs["qwen2"]
    spec = MicroBatchSpec(max_token_len=BUDGET)
    switches = dict(use_remove_padding=True, use_fused_kernels=True)
    expected = FSDPEngine(engine_options(model_dir)).forward(batch, SAMPLES, compute_entropy=True)
    output = FSDPEngine(engine_options(model_dir, **switches)).forward(batch, spec, compute_entropy=True)
    torch.testing.assert_close(masked(output.log_probs, batch), masked(expected.log_probs, batch), **TOLERANCE)
    torch.testing.assert_close(masked(output.entropy, batch), masked(expected.entropy, batch), **TOLERANCE)
    assert_same_update(updated_weights(model_dir, batch, spec, **switches),
                       updated_weights(model_dir, batch, 2), model_dir)


@pytest.mark.slow
def test_two_ranks_packed_and_fused_match_one_padded_process(model_dirs, batch, tmp_path):
    model_dir = model_dirs["qwen2"]  # tied: the head's gradient also reaches the embedding
    run_two_ranks(WORKER, model_dir, str(tmp_path), timeout=120)
    result = torch.load(tmp_path / "result.pt")

    expected = FSDPEngine(engine_options(model_dir)).forward(batch, SAMPLES, compute_entropy=True)
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(masked(result[name], batch), masked(getattr(expected, name), batch), **TOLERANCE)
    assert_same_update((result["metrics"], result["weights"]), updated_weights(model_dir, batch, SAMPLES), model_dir)


# --- the trainers -----------------------------------------------------------------------------------


def test_rl_run_with_packing_and_fused_kernels(inputs, tmp_path):
    """Two PPO steps (critic, reference for the KL loss, entropy bonus) with both switches on."""
    run_dir = tmp_path / "run"
    trainer = train(run_overrides(
        inputs, run_dir, "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=true",
        "critic.model.use_remove_padding=true"))
    parts = trainer.parts
    for engine in (parts.actor.in_process().engine, parts.reference.in_process().engine):
        assert engine.options.use_remove_padding and engine.options.use_fused_kernels
    assert parts.critic.in_process().engine.options.use_remove_padding and not parts.critic.in_process().engine.options.use_fused_kernels
    metrics = metrics_by_step(run_dir)
    assert trainer.step == 2 and {1, 2} <= set(metrics)
    for step in (1, 2):
        assert all_finite(metrics[step][key] for key in ("actor/loss", "actor/grad_norm", "critic/vf_loss"))
        assert metrics[step]["actor/grad_norm"] > 0 and metrics[step]["critic/grad_norm"] > 0


def test_sft_use_rmpad_and_token_budget_give_the_padded_step(tmp_path):
    """`training.use_rmpad` (the Megatron-style dialect's name) turns packing on for SFT and
    `data.use_dynamic_bsz` forms micro-batches by tokens; the first step's loss and gradient
    norm are the padded, fixed-size ones."""
    from fixtures import make_tiny_model_dir

    from ember.data.parquet import write_parquet
    from ember.data.preprocess.synthetic import make_arithmetic_rows, sft_row_from_rl_row
    from ember.trainer.sft import SFTTrainer

    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 8, seed=0)]
    model_dir, train_file = make_tiny_model_dir(tmp_path), write_parquet(rows, tmp_path / "train.parquet")
    results = {}
    for packed, dynamic in ((False, False), (True, False), (True, True), (False, True)):
        cfg = load_config(["data.multiturn.enable=true", f"data.train_files={train_file}", "data.max_length=64",
                           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
                           f"data.use_dynamic_bsz={dynamic}", "data.max_token_len_per_gpu=64",
                           f"model.partial_pretrain={model_dir}",
                           f"trainer.default_local_dir={tmp_path / f'{packed}-{dynamic}'}",
                           f"training.use_rmpad={str(packed).lower()}"], schema=SFTConfig)
        trainer = SFTTrainer(cfg)
        assert trainer.engine.options.use_remove_padding is packed
        examples = [trainer.train_loader.dataset[i] for i in range(8)]
        step = trainer.train_step(examples)
        results[packed, dynamic] = (step["train/loss"], step["train/grad_norm"])
        trainer.logger.close()
    reference = results[False, False]
    for key, (loss, grad_norm) in results.items():
        assert loss == pytest.approx(reference[0], abs=1e-6), key
        assert grad_norm == pytest.approx(reference[1], rel=1e-5), key
