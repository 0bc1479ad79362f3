"""The FSDP2 engine on an accelerator: bf16 compute over fp32 master weights, activation
checkpointing, offload that really moves shards and optimizer state off the device, and
FSDP2's CPUOffloadPolicy (shards and optimizer on CPU for good) training like the resident engine,
compiled layers (packed and padded) training like eager ones, and checkpoints of offloaded engines."""

import pytest
import torch
from integration.fsdp_engine_worker import engine_options, make_batch, make_model_dir, mean_log_prob_loss
from transformers import AutoModelForCausalLM

from ember.distributed.device import device_type
from ember.engines.fsdp.engine import FSDPEngine

pytestmark = pytest.mark.gpu


def local_devices(tensors) -> set[str]:
    return {tensor.to_local().device.type for tensor in tensors}


def test_bf16_training_with_checkpointing_and_offload(tmp_path):
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    engine = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", enable_gradient_checkpointing=True,
                                       param_offload=True, optimizer_offload=True))
    parameters = list(engine.module().parameters())
    assert local_devices(parameters) == {device_type()}
    assert {parameter.dtype for parameter in parameters} == {torch.float32}

    batch = make_batch()
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(model_dir)(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    expected = torch.log_softmax(reference[:, batch.response_prediction_positions].float(), -1).gather(
        -1, batch.responses.unsqueeze(-1)).squeeze(-1)
    output = engine.forward(batch, micro_batch_size=2)
    assert output.log_probs.device == batch.input_ids.device
    mask = batch.response_mask.bool()
    torch.testing.assert_close(output.log_probs[mask], expected[mask], atol=0.05, rtol=0)

    losses, host_pointers = [], []
    for _ in range(4):
        losses.append(engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)["loss"])
        allocated = torch.accelerator.memory_allocated()
        before = [p.to_local().clone() for p in engine.module().parameters()]
        moments = [state["exp_avg"].to_local().clone() for state in engine.optimizer.state.values()]
        engine.offload()
        assert local_devices(engine.module().parameters()) == {"cpu"}
        assert local_devices(state["exp_avg"] for state in engine.optimizer.state.values()) == {"cpu"}
        assert torch.accelerator.memory_allocated() < allocated
        offloaded = [p.to_local() for p in engine.module().parameters()]
        offloaded += [state["exp_avg"].to_local() for state in engine.optimizer.state.values()]
        assert all(tensor.is_pinned() for tensor in offloaded)  # the bus's speed, no staging copies
        host_pointers.append([tensor.data_ptr() for tensor in offloaded])  # pinned once, then reused
        engine.onload()
        assert local_devices(engine.module().parameters()) == {device_type()}
        for expected, actual in zip(before, engine.module().parameters()):
            assert torch.equal(actual.to_local(), expected)
        for expected, state in zip(moments, engine.optimizer.state.values()):
            assert torch.equal(state["exp_avg"].to_local(), expected)
    assert all(pointers == host_pointers[0] for pointers in host_pointers)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_offload_policy_keeps_shards_on_cpu_and_trains_like_the_resident_engine(tmp_path):
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    batch = make_batch()
    before = torch.accelerator.memory_allocated()
    offloaded = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", offload_policy=True))
    parameter_bytes = sum(p.numel() * p.element_size() for p in offloaded.module().parameters())
    assert torch.accelerator.memory_allocated() - before < parameter_bytes / 4  # the weights are not on the device
    assert local_devices(offloaded.module().parameters()) == {"cpu"}
    assert {buffer.device.type for buffer in offloaded.module().buffers()} == {device_type()}  # RoPE tables compute there
    resident = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16"))

    for _ in range(3):
        expected = resident.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        actual = offloaded.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        torch.testing.assert_close(actual["loss"], expected["loss"], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(actual["grad_norm"], expected["grad_norm"], atol=1e-3, rtol=1e-2)
    assert local_devices(offloaded.module().parameters()) == {"cpu"}
    assert local_devices(state["exp_avg"] for state in offloaded.optimizer.state.values()) == {"cpu"}
    offloaded.offload(), offloaded.onload()  # nothing to move: the policy keeps them on CPU
    assert local_devices(offloaded.module().parameters()) == {"cpu"}
    mask = batch.response_mask.bool()
    torch.testing.assert_close(offloaded.forward(batch, micro_batch_size=2).log_probs[mask],
                               resident.forward(batch, micro_batch_size=2).log_probs[mask], atol=2e-2, rtol=0)
    assert local_devices(offloaded.module().parameters()) == {"cpu"}  # resharded after forward: no copy stays
    synced = dict(pair for bucket in offloaded.named_parameters_for_sync() for pair in bucket)
    assert not offloaded.syncs_live_parameters
    assert {(tensor.device.type, tensor.dtype) for tensor in synced.values()} == {(device_type(), torch.bfloat16)}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_compiled_layers_train_like_eager_ones_on_bf16_batches(tmp_path, packed):
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    batch = make_batch()
    settings = dict(param_dtype="bfloat16", enable_gradient_checkpointing=True, use_remove_padding=packed)
    eager = FSDPEngine(engine_options(model_dir, **settings))
    compiled = FSDPEngine(engine_options(model_dir, compile_layers=True, **settings))
    for _ in range(3):
        expected = eager.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        actual = compiled.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        torch.testing.assert_close(actual["loss"], expected["loss"], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(actual["grad_norm"], expected["grad_norm"], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("offload", ["offload_policy", "param_and_optimizer_offload"])
def test_checkpoint_round_trip_with_offloaded_state(tmp_path, offload):
    """Save, train on, load: the weights and the optimizer come back, and the next step repeats the one
    taken right after saving; with the offload policy the loaded shards stay in CPU memory."""
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    switches = ({"offload_policy": True} if offload == "offload_policy"
                else {"param_offload": True, "optimizer_offload": True})
    engine = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", **switches))
    batch = make_batch()
    engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)  # optimizer state to save
    engine.offload()
    with engine.resident():
        engine.save(str(tmp_path / "checkpoint"))
        saved = [p.full_tensor().cpu().clone() for p in engine.module().parameters()]
        after_save = engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        engine.load(str(tmp_path / "checkpoint"))
        for expected, parameter in zip(saved, engine.module().parameters()):
            assert torch.equal(parameter.full_tensor().cpu(), expected)
        if offload == "offload_policy":
            assert local_devices(engine.module().parameters()) == {"cpu"}
        again = engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    torch.testing.assert_close(again["loss"], after_save["loss"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(again["grad_norm"], after_save["grad_norm"], atol=1e-6, rtol=1e-5)
