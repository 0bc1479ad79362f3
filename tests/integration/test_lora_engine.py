"""LoRA on the FSDP2 engine at world size 1 on CPU: the update against a plain-torch LoRA and Adam by
hand, a frozen base, the reference as the adapter-off module, merged weights for the rollout engine,
PEFT's adapter folder and the merged export, an adapter-only checkpoint that resumes exactly, and 2 gloo
ranks (torchrun) streaming, saving and exporting what one process does."""

import os
from dataclasses import replace

import pytest
import torch
from fsdp_engine_worker import engine_options, make_batch, make_model_dir, mean_log_prob_loss
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from ember.engines.base import MicroBatchSpec
from ember.engines.dcp_folder import saved_tensor_shapes
from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.lora import LoraOptions, hf_name, is_adapter_name, to_peft_name
from ember.engines.optim import OptimOptions
from ember.workers.reference import Reference

LORA = LoraOptions(rank=2, alpha=6.0, target_modules=("q_proj", "v_proj", "down_proj"))
SCALE = LORA.alpha / LORA.rank
ADAM = OptimOptions(lr=0.05, eps=1e-2, weight_decay=0.0, clip_grad=0.0)  # no clipping: the update is Adam's alone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir("llama", str(tmp_path_factory.mktemp("llama")))


def lora_engine(model_dir, **overrides) -> FSDPEngine:
    return FSDPEngine(replace(engine_options(model_dir, optim=ADAM), **{"lora": LORA, **overrides}))


def local(parameter) -> torch.Tensor:
    """The whole tensor at one rank (FSDP2 leaves a DTensor between steps, a plain tensor after a forward)."""
    return (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach()


def adapter(engine) -> dict[str, torch.Tensor]:
    return {name: local(parameter).clone() for name, parameter in engine.module().named_parameters()
            if is_adapter_name(name)}


def log_probs_of(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits.float()
    log_softmax = torch.log_softmax(logits[:, batch.prompt_length - 1:-1], dim=-1)
    return log_softmax.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def with_lora_by_hand(model, tensors: dict[str, torch.Tensor]):
    """Forward hooks adding scale · x Aᵀ Bᵀ to each adapted layer of a plain transformers model."""
    for module_name, module in model.named_modules():
        a_name = f"{module_name}.lora_A.default.weight"
        if a_name in tensors:
            lora_a, lora_b = tensors[a_name], tensors[f"{module_name}.lora_B.default.weight"]
            module.register_forward_hook(
                lambda _, inputs, output, a=lora_a, b=lora_b: output + SCALE * (inputs[0] @ a.T) @ b.T)
    return model


def test_lora_update_equals_plain_torch_lora_and_adam_by_hand(model_dir):
    engine = lora_engine(model_dir)
    trained = [parameter for group in engine.optimizer.param_groups for parameter in group["params"]]
    names = {id(parameter): name for name, parameter in engine.module().named_parameters()}
    assert sorted(names[id(parameter)] for parameter in trained) == sorted(adapter(engine))
    assert len(trained) == 2 * 3 * 2  # A and B of 3 targets in each of the 2 layers: no state for the base
    assert all(parameter.dtype == torch.float32 for parameter in trained)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    batch = make_batch()

    tensors = {name: tensor.clone().requires_grad_(True) for name, tensor in adapter(engine).items()}
    by_hand = with_lora_by_hand(base, tensors)
    moments = {name: (torch.zeros_like(tensor), torch.zeros_like(tensor)) for name, tensor in tensors.items()}
    beta1, beta2 = ADAM.betas
    for step in (1, 2):
        # the reference's forward (adapter off) between updates must leave training as it was
        Reference(engine, micro_batch=2, temperature=1.0).compute_log_probs(batch)
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
        loss = -(log_probs_of(by_hand, batch) * batch.response_mask).sum() / batch.response_mask.sum()
        gradients = torch.autograd.grad(loss, list(tensors.values()))
        with torch.no_grad():
            for (name, tensor), gradient in zip(tensors.items(), gradients):
                first, second = moments[name]
                first.mul_(beta1).add_((1 - beta1) * gradient)
                second.mul_(beta2).add_((1 - beta2) * gradient * gradient)
                step_size = ADAM.lr / (1 - beta1 ** step)
                tensor -= step_size * first / ((second / (1 - beta2 ** step)).sqrt() + ADAM.eps)
    updated = adapter(engine)
    assert any(not torch.equal(updated[name], tensor) for name, tensor in adapter(lora_engine(model_dir)).items())
    for name, tensor in tensors.items():
        torch.testing.assert_close(updated[name], tensor.detach(), atol=2e-6, rtol=1e-5, msg=name)
    for name, parameter in engine.module().named_parameters():  # the base, bit for bit
        if not is_adapter_name(name):
            assert not parameter.requires_grad
            assert torch.equal(local(parameter), base_state[hf_name(name)]), name


@pytest.fixture(scope="module")
def trained(model_dir):
    engine = lora_engine(model_dir)
    batch = make_batch()
    for _ in range(3):
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    return engine, batch


def test_reference_is_the_base_model_and_sync_sends_the_merged_adapted_layers(trained, model_dir):
    engine, batch = trained
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mask = batch.response_mask.bool()
    with torch.no_grad():
        expected = log_probs_of(base, batch)
    reference = Reference(engine, micro_batch=2, temperature=1.0).compute_log_probs(batch)
    torch.testing.assert_close(reference[mask], expected[mask], atol=1e-5, rtol=0)

    changed = dict(pair for bucket in engine.named_parameters_for_sync(bucket_bytes=4096, trained_only=True)
                   for pair in bucket)
    targets = {f"model.layers.{layer}.{module}.weight" for layer in (0, 1)
               for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert set(changed) == targets
    tensors = adapter(engine)
    for name, merged in changed.items():
        module = name.removesuffix(".weight")
        lora_a, lora_b = tensors[f"{module}.lora_A.default.weight"], tensors[f"{module}.lora_B.default.weight"]
        torch.testing.assert_close(merged, base.state_dict()[name] + SCALE * lora_b @ lora_a, atol=1e-6, rtol=0)
    full = dict(pair for bucket in engine.named_parameters_for_sync(bucket_bytes=4096) for pair in bucket)
    assert set(full) == set(dict(base.named_parameters()))
    base.load_state_dict(full)  # a rollout engine given these weights generates with the trained policy
    with torch.no_grad():
        synced = log_probs_of(base, batch)
    torch.testing.assert_close(synced[mask], engine.forward(batch, 2).log_probs[mask], atol=1e-5, rtol=0)


def test_exported_adapter_loads_with_peft_and_the_merged_export_with_transformers(trained, model_dir, tmp_path):
    engine, batch = trained
    mask = batch.response_mask.bool()
    trained_log_probs = engine.forward(batch, 2).log_probs[mask]
    engine.export_lora_adapter(str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           str(tmp_path / "adapter"))
    engine.export_hf(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        for model in (peft_model, merged):
            torch.testing.assert_close(log_probs_of(model, batch)[mask], trained_log_probs, atol=1e-5, rtol=0)
    start = lora_engine(model_dir, lora=replace(LORA, adapter_path=str(tmp_path / "adapter")))
    assert all(torch.equal(tensor, adapter(engine)[name]) for name, tensor in adapter(start).items())


def test_checkpoint_holds_the_adapter_alone_and_resumes_exactly(model_dir, tmp_path):
    batch = make_batch()
    uninterrupted = lora_engine(model_dir)
    expected = [uninterrupted.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2) for _ in range(4)]
    first = lora_engine(model_dir)
    metrics = [first.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2) for _ in range(2)]
    first.save(str(tmp_path / "checkpoint"))
    saved = saved_tensor_shapes(str(tmp_path / "checkpoint" / "model"))
    assert set(saved) == set(adapter(first))
    resumed = FSDPEngine(replace(first.options, seed=first.options.seed + 1))  # other A's until the load
    assert resumed.checkpoint_problem(str(tmp_path / "checkpoint")) is None
    resumed.load(str(tmp_path / "checkpoint"))
    metrics += [resumed.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2) for _ in range(2)]
    assert metrics == expected
    final = adapter(resumed)
    assert all(torch.equal(final[name], tensor) for name, tensor in adapter(uninterrupted).items())


@pytest.mark.slow
def test_two_ranks_stream_save_and_export_what_one_process_does(model_dir, tmp_path):
    from lora_two_ranks_worker import lora_engine as two_rank_engine
    from two_ranks import run_two_ranks

    run_two_ranks(os.path.join(os.path.dirname(__file__), "lora_two_ranks_worker.py"), model_dir, str(tmp_path),
                  timeout=120)
    streams = torch.load(tmp_path / "result.pt")
    engine = two_rank_engine(model_dir)
    batch = make_batch()
    for _ in range(2):
        engine.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=4)
    for trained_only, streamed in streams.items():
        expected = dict(pair for bucket in engine.named_parameters_for_sync(trained_only=trained_only)
                        for pair in bucket)
        assert streamed.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(streamed[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert len(streams[True]) == 2 * 7  # all-linear: the 7 linear layers of each of the 2 decoder layers
    resumed = two_rank_engine(model_dir)
    resumed.load(str(tmp_path / "checkpoint"))  # the 2-rank adapter checkpoint at one rank
    peft_file = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for name, tensor in adapter(engine).items():
        torch.testing.assert_close(adapter(resumed)[name], tensor, atol=1e-6, rtol=0)
        torch.testing.assert_close(peft_file[to_peft_name(name)], tensor, atol=1e-6, rtol=0)


def test_the_frozen_base_is_stored_in_the_compute_dtype_and_the_adapters_train_in_fp32(model_dir):
    """With bf16 compute over fp32 masters, the base never takes a step: it is kept in bf16 (a 7B base in 15 GB,
    not 30), the adapters in fp32, and a bf16 update moves the adapters alone."""
    engine = lora_engine(model_dir, param_dtype="bfloat16")
    dtypes = {name: local(parameter).dtype for name, parameter in engine.module().named_parameters()}
    assert {dtype for name, dtype in dtypes.items() if is_adapter_name(name)} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if not is_adapter_name(name)} == {torch.bfloat16}
    base = {name: local(parameter).clone() for name, parameter in engine.module().named_parameters()
            if not is_adapter_name(name)}
    before = adapter(engine)
    metrics = engine.train_mini_batch(make_batch(samples=4), mean_log_prob_loss, MicroBatchSpec(size=2))
    assert float(metrics["grad_norm"]) > 0
    assert any(not torch.equal(before[name], tensor) for name, tensor in adapter(engine).items())
    for name, parameter in engine.module().named_parameters():
        if not is_adapter_name(name):
            assert torch.equal(local(parameter), base[name]), name
