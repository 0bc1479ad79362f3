"""The FSDP2 engine at world size 1 on CPU: numerics against plain transformers, training,
micro-batch invariance, checkpoints, HF export, critic, reference and offload."""

import math

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
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.optim import OptimOptions, lr_multiplier
from ember.models.tiny import TINY_ARCHS


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, str(tmp_path_factory.mktemp(request.param)))


def reference_log_probs_and_entropy(model, batch, temperature):
    """Full-sequence logits from plain transformers, then the response slice, log_softmax and -Σ p log p."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    logits = logits[:, batch.prompt_length - 1:-1] / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_forward_matches_transformers(arch, tmp_path):
    model_dir = make_model_dir(arch, str(tmp_path))
    engine = FSDPEngine(engine_options(model_dir))
    batch = make_batch(samples=5)
    output = engine.forward(batch, micro_batch_size=2, compute_entropy=True, temperature=0.7)
    expected_log_probs, expected_entropy = reference_log_probs_and_entropy(
        AutoModelForCausalLM.from_pretrained(model_dir), batch, temperature=0.7)
    mask = batch.response_mask.bool()
    assert output.log_probs.shape == (5, batch.response_length) and output.values is None
    torch.testing.assert_close(output.log_probs[mask], expected_log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(output.entropy[mask], expected_entropy[mask], atol=1e-5, rtol=0)


def test_training_lowers_the_loss(model_dir):
    engine = FSDPEngine(engine_options(model_dir))
    batch = make_batch()
    before = full_weights(engine)
    losses = [engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)["loss"] for _ in range(4)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    after = full_weights(engine)
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])


def test_first_loss_and_metrics_are_the_mini_batch_values(model_dir):
    engine = FSDPEngine(engine_options(model_dir))
    batch = make_batch()
    log_probs = engine.forward(batch, micro_batch_size=4).log_probs
    expected_loss = -(log_probs * batch.response_mask).sum() / batch.response_mask.sum()
    metrics = engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=3)
    assert metrics["loss"] == pytest.approx(expected_loss.item(), abs=1e-5)
    assert metrics["micro_tokens"] == pytest.approx(batch.response_mask.sum().item() / 2)  # mean over 2 micro-batches
    assert metrics["lr"] == 1e-3 and metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0


def test_micro_batch_size_does_not_change_the_update(model_dir):
    batch = make_batch()
    updated = []
    for micro_batch_size in (1, 4):
        engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=micro_batch_size)
        updated.append(full_weights(engine))
    for name, weight in updated[0].items():
        torch.testing.assert_close(weight, updated[1][name], atol=1e-6, rtol=0, msg=name)


def test_non_finite_gradients_skip_the_step(model_dir):
    engine = FSDPEngine(engine_options(model_dir))
    before = full_weights(engine)

    def exploding_loss(output, batch, context):
        loss, metrics = mean_log_prob_loss(output, batch, context)
        return loss * math.inf, metrics

    metrics = engine.train_mini_batch(make_batch(), exploding_loss, micro_batch_size=2)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    for name, weight in full_weights(engine).items():
        assert torch.equal(weight, before[name]), name
    assert engine.lr_scheduler.last_epoch == 0  # the schedule did not advance either


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    options = OptimOptions(lr=1.0, lr_warmup_steps_ratio=0.2, lr_scheduler_type="cosine",
                           total_training_steps=10, min_lr_ratio=0.1)
    multipliers = [lr_multiplier(step, options) for step in range(11)]
    assert multipliers[:3] == [0.0, 0.5, 1.0]  # 2 warmup steps
    assert multipliers[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert multipliers[10] == pytest.approx(0.1)
    assert all(later <= earlier for earlier, later in zip(multipliers[2:], multipliers[3:]))
    constant = OptimOptions(lr_warmup_steps=0)
    assert [lr_multiplier(step, constant) for step in (0, 100)] == [1.0, 1.0]
    with pytest.raises(ValueError, match="total_training_steps"):
        OptimOptions(lr_scheduler_type="cosine")


def test_save_load_resumes_the_exact_next_update(model_dir, tmp_path):
    optim = OptimOptions(lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine", total_training_steps=6)
    batches = [make_batch(seed) for seed in range(4)]
    original = FSDPEngine(engine_options(model_dir, optim=optim))
    for batch in batches[:3]:
        original.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    original.save(str(tmp_path / "checkpoint"))
    expected = original.train_mini_batch(batches[3], mean_log_prob_loss, micro_batch_size=2)

    resumed = FSDPEngine(engine_options(model_dir, optim=optim))
    resumed.load(str(tmp_path / "checkpoint"))
    metrics = resumed.train_mini_batch(batches[3], mean_log_prob_loss, micro_batch_size=2)
    # step 3 is a quarter into the cosine decay (steps 2..6): lr · ½(1 + cos(π/4))
    assert metrics["lr"] == expected["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert metrics["loss"] == expected["loss"]
    resumed_weights = full_weights(resumed)
    for name, weight in full_weights(original).items():
        assert torch.equal(weight, resumed_weights[name]), name


def test_export_hf_loads_in_transformers_with_identical_log_probs(model_dir, tmp_path):
    engine = FSDPEngine(engine_options(model_dir))
    batch = make_batch()
    engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=4)
    engine.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(exported).__name__ == type(AutoModelForCausalLM.from_pretrained(model_dir)).__name__
    expected, _ = reference_log_probs_and_entropy(exported, batch, temperature=1.0)
    actual = engine.forward(batch, micro_batch_size=4).log_probs
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_sync_streams_full_weights_under_hf_names_in_buckets(model_dir):
    engine = FSDPEngine(engine_options(model_dir))
    buckets = list(engine.named_parameters_for_sync(bucket_bytes=64 * 64 * 4))
    assert len(buckets) > 1
    synced = {name: tensor.cpu() for bucket in buckets for name, tensor in bucket}
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    expected = dict(hf_model.named_parameters())  # tied weights appear once
    assert synced.keys() == expected.keys()
    for name, tensor in synced.items():
        assert torch.equal(tensor, expected[name].detach()), name


def test_critic_values_and_value_loss_training(model_dir, tmp_path):
    engine = FSDPEngine(engine_options(model_dir, role="critic", optim=OptimOptions(lr=1e-3, weight_decay=0.0)))
    batch = make_batch()
    values = engine.forward(batch, micro_batch_size=3).values
    assert values.shape == (len(batch), batch.response_length)
    assert torch.all(values[batch.response_mask == 0] == 0)

    def value_loss(output, micro_batch, context):
        squared_error = (output.values - 1.0) ** 2 * micro_batch.response_mask
        return squared_error.sum() / context.num_tokens, {}

    losses = [engine.train_mini_batch(batch, value_loss, micro_batch_size=2)["loss"] for _ in range(4)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses

    engine.export_hf(str(tmp_path / "critic"))
    exported = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    with torch.no_grad():
        logits = exported(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids).logits[:, batch.response_prediction_positions, 0]
    torch.testing.assert_close(engine.forward(batch, 4).values, logits * batch.response_mask, atol=1e-5, rtol=0)


def test_reference_engine_computes_but_does_not_train(model_dir):
    engine = FSDPEngine(engine_options(model_dir, role="ref"))
    assert engine.forward(make_batch(), micro_batch_size=4).log_probs is not None
    with pytest.raises(RuntimeError, match="role 'ref'"):
        engine.train_mini_batch(make_batch(), mean_log_prob_loss, micro_batch_size=4)


def test_offload_onload_round_trip_keeps_training_identical(model_dir):
    batches = [make_batch(seed) for seed in range(2)]
    results = []
    for offload in (False, True):
        engine = FSDPEngine(engine_options(model_dir, param_offload=offload, optimizer_offload=offload))
        engine.train_mini_batch(batches[0], mean_log_prob_loss, micro_batch_size=2)
        engine.offload()
        engine.onload()
        engine.train_mini_batch(batches[1], mean_log_prob_loss, micro_batch_size=2)
        results.append(full_weights(engine))
    for name, weight in results[0].items():
        assert torch.equal(weight, results[1][name]), name


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update(model_dir):
    batch = make_batch()
    updated, attention_calls = [], []
    for checkpointing in (False, True):
        engine = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM,
                                           enable_gradient_checkpointing=checkpointing))
        calls = []
        engine.module().model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        updated.append(full_weights(engine))
        attention_calls.append(len(calls))
    assert attention_calls == [2, 4]  # 2 micro-batches; checkpointing runs each layer again in backward
    for name, weight in updated[0].items():
        torch.testing.assert_close(weight, updated[1][name], atol=1e-6, rtol=0, msg=name)


def test_bf16_compute_keeps_fp32_master_weights(model_dir):
    engine = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16"))
    batch = make_batch()
    fp32_log_probs = FSDPEngine(engine_options(model_dir)).forward(batch, micro_batch_size=4).log_probs
    bf16_log_probs = engine.forward(batch, micro_batch_size=4).log_probs
    assert bf16_log_probs.dtype == torch.float32
    mask = batch.response_mask.bool()
    assert not torch.equal(bf16_log_probs[mask], fp32_log_probs[mask])
    torch.testing.assert_close(bf16_log_probs[mask], fp32_log_probs[mask], atol=0.05, rtol=0)
    engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    assert all(parameter.dtype == torch.float32 for parameter in engine.module().parameters())
    assert all(tensor.dtype == torch.bfloat16 for bucket in engine.named_parameters_for_sync() for _, tensor in bucket)


def test_compile_decoder_layers_compiles_each_layer_forward_and_a_cpu_engine_ignores_the_switch(model_dir):
    from ember.engines.fsdp.parallelize import compile_decoder_layers

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    names = [name for name, _ in model.named_parameters()]
    compile_decoder_layers(model)  # torch.compile wraps each layer's forward, keeping the original callable
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.model.layers)
    assert [name for name, _ in model.named_parameters()] == names
    engine = FSDPEngine(engine_options(model_dir, compile_layers=True))
    assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in engine.module().model.layers)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_one_rank_makes_the_root_the_only_unit_and_updates_as_a_unit_per_layer_does(
        model_dir, monkeypatch, gradient_checkpointing):
    """At one rank a FSDP2 unit per decoder layer shards nothing; the root alone is the unit. The
    update (bf16 compute, fp32 master weights, two micro-batches) is the one per-layer units give."""
    from torch.distributed.fsdp import FSDPModule

    import ember.engines.fsdp.engine as fsdp_engine

    options = engine_options(model_dir, param_dtype="bfloat16", enable_gradient_checkpointing=gradient_checkpointing)
    batch = make_batch()
    root_only = FSDPEngine(options)
    assert isinstance(root_only.module(), FSDPModule)
    assert not any(isinstance(layer, FSDPModule) for layer in root_only.module().model.layers)
    losses = [root_only.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=3)["loss"] for _ in range(2)]

    build = fsdp_engine.build_sharded_model
    monkeypatch.setattr(fsdp_engine, "build_sharded_model", lambda *a, **kw: build(*a, **{**kw, "shard_layers": True}))
    per_layer = FSDPEngine(options)
    assert all(isinstance(layer, FSDPModule) for layer in per_layer.module().model.layers)
    assert [per_layer.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=3)["loss"] for _ in range(2)] == losses
    expected = full_weights(per_layer)
    for name, weight in full_weights(root_only).items():
        assert torch.equal(weight, expected[name]), name


def fake_liger(monkeypatch, model_types):
    """A stand-in liger_kernel package: its per-model-type table and the instance patcher, recording calls."""
    import sys
    import types

    calls = []
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {name: None for name in model_types}
    monkey_patch._apply_liger_kernel_to_instance = lambda **kwargs: calls.append(kwargs)
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", monkey_patch)
    return calls


def test_liger_kernels_patch_the_model_without_their_cross_entropy_and_refuse_a_type_they_lack(monkeypatch, tmp_path):
    from ember.engines.fsdp.parallelize import apply_liger_kernels
    from ember.errors import UserError

    model = AutoModelForCausalLM.from_pretrained(make_model_dir("qwen2", str(tmp_path)))
    calls = fake_liger(monkeypatch, ["qwen2", "llama"])
    apply_liger_kernels(model)
    assert len(calls) == 1 and calls[0]["model"] is model
    assert calls[0]["rms_norm"] and calls[0]["swiglu"] and calls[0]["rope"]
    assert not calls[0]["fused_linear_cross_entropy"] and not calls[0]["cross_entropy"]
    fake_liger(monkeypatch, ["llama"])
    with pytest.raises(UserError, match="no kernels for model type 'qwen2' .* set use_liger=false"):
        apply_liger_kernels(model)


def test_liger_kernels_missing_say_what_to_install_and_a_cpu_engine_ignores_the_switch(monkeypatch, model_dir):
    import sys

    from ember.engines.fsdp.parallelize import apply_liger_kernels
    from ember.errors import UserError

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    with pytest.raises(UserError, match="pip install liger-kernel"):
        apply_liger_kernels(AutoModelForCausalLM.from_pretrained(model_dir))
    engine = FSDPEngine(engine_options(model_dir, use_liger=True))  # Triton kernels: an accelerator's switch
    assert engine.forward(make_batch(samples=2), micro_batch_size=2).log_probs.shape[0] == 2


def test_the_root_is_the_only_unit_only_where_its_extra_memory_fits_and_not_under_offload(model_dir, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from ember.engines.fsdp.parallelize import ROOT_UNIT_BYTES_PER_PARAMETER, ROOT_UNIT_MEMORY_FRACTION, root_unit_fits

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    extra = sum(p.numel() for p in model.parameters()) * ROOT_UNIT_BYTES_PER_PARAMETER
    assert root_unit_fits(model, torch.device("cpu"))
    for total, fits in ((extra / ROOT_UNIT_MEMORY_FRACTION, True), (extra / ROOT_UNIT_MEMORY_FRACTION - 1, False)):
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device, total=total: (0, int(total)))
        assert root_unit_fits(model, torch.device("cuda")) is fits
    monkeypatch.undo()
    offloaded = FSDPEngine(engine_options(model_dir, param_offload=True, optimizer_offload=True))
    assert all(isinstance(layer, FSDPModule) for layer in offloaded.module().model.layers)


def test_full_determinism_turns_on_the_deterministic_kernels_of_the_process(model_dir, monkeypatch):
    import os

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        FSDPEngine(engine_options(model_dir))
        assert not torch.are_deterministic_algorithms_enabled()  # off unless asked
        FSDPEngine(engine_options(model_dir, full_determinism=True))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
