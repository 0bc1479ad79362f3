"""LoRA through the commands on a tiny model on CPU: a GRPO run with the KL loss (the reference is the
actor's module with the adapter off) on ember's engine, its checkpoint and `ember export` (PEFT's adapter
folder and the merged model); `ember sft` with LoRA, its exports, and a resume equal to an uninterrupted run."""

from __future__ import annotations

import torch
from peft import PeftModel
from rl_helpers import build_trainer, close, engine_weights, hf_weights, metrics_by_step, prepare_inputs, run_overrides
from safetensors.torch import load_file
from test_sft import run_args, train_losses, workspace  # noqa: F401  (the SFT run's files)
from transformers import AutoModelForCausalLM

from ember.cli import main as ember_main
from ember.data.batch import Batch
from ember.engines.dcp_folder import saved_tensor_shapes
from ember.engines.lora import hf_name, is_adapter_name

A = "actor_rollout_ref"
LORA_KEYS = (f"{A}.model.lora_rank=4", f"{A}.model.lora_alpha=8", f"{A}.actor.optim.lr=2e-2")


def log_probs_of(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    log_softmax = torch.log_softmax(logits[:, batch.prompt_length - 1:-1], dim=-1)
    return log_softmax.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def test_grpo_with_lora_and_kl_loss_trains_the_adapter_against_the_base_and_exports_it(tmp_path):
    inputs = prepare_inputs(tmp_path / "inputs")
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, f"{A}.rollout.name=ember", f"{A}.actor.use_kl_loss=True",
                                          f"{A}.actor.kl_loss_coef=0.1", "trainer.save_freq=3", *LORA_KEYS))
    synced: list[set[str]] = []
    try:
        rollout_engine = trainer.parts.rollout.in_process().rollout
        update_weights = rollout_engine.update_weights

        def recording(bucket):
            synced[-1].update(name for name, _ in bucket)
            return update_weights(bucket)

        rollout_engine.update_weights = recording
        prepare = trainer.parts.rollout.in_process().prepare

        def prepare_recording():
            synced.append(set())
            return prepare()

        trainer.parts.rollout.in_process().prepare = prepare_recording
        trainer.fit()
        actor = trainer.parts.actor.in_process()
        module = actor.engine.module()
        # the generation engine got the merged weights of the last update
        rollout_weights = dict(rollout_engine.engine.model.named_parameters())
        for name, tensor in engine_weights(actor.engine).items():
            torch.testing.assert_close(rollout_weights[name].float(), tensor.float(), rtol=0, atol=0)
        base = hf_weights(inputs.model_dir)
        for name, parameter in module.named_parameters():
            if not is_adapter_name(name):  # the base, bit for bit
                assert torch.equal(parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter,
                                   base[hf_name(name)]), name
        tokenizer = trainer.parts.tokenizer
        batch = Batch.from_rollout([tokenizer("What is 12 + 30?")["input_ids"]], [tokenizer(" 42 #### 42")["input_ids"]],
                                   pad_token_id=tokenizer.pad_token_id)
        trained_log_probs = actor.compute_log_probs(batch)
        every_weight = set(engine_weights(actor.engine))
        adapted = {name for bucket in actor.engine.named_parameters_for_sync(trained_only=True) for name, _ in bucket}
    finally:
        close(trainer)
    full, *later = [names for names in synced if names]  # the first sync sends every weight, the others the adapted
    assert full == every_weight and len(later) >= 2 and all(names == adapted for names in later)
    assert len(adapted) == 2 * 7  # every linear layer of the 2 decoder layers (all-linear), merged
    metrics = metrics_by_step(run_dir)
    assert metrics[1]["actor/kl_loss"] == 0.0 < metrics[3]["actor/kl_loss"]  # B starts at 0: the base, then not

    assert set(saved_tensor_shapes(str(run_dir / "global_step_3" / "actor" / "model"))) == {
        name for name, _ in module.named_parameters() if is_adapter_name(name)}
    assert ember_main(["export", str(run_dir / "global_step_3"), str(tmp_path / "adapter")]) == 0
    assert ember_main(["export", "--merged", str(run_dir / "global_step_3"), str(tmp_path / "merged")]) == 0
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(inputs.model_dir, dtype=torch.float32),
                                             str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    for model in (with_adapter, merged):
        torch.testing.assert_close(log_probs_of(model, batch), trained_log_probs, atol=1e-5, rtol=0)


def sft_lora_args(workspace, run_dir, *extra):  # noqa: F811
    # a constant schedule: the interrupted run is two runs of 2 and 4 steps
    return run_args(workspace, run_dir, "model.lora_rank=4", "model.lora_alpha=16",
                    "model.target_modules=[q_proj,v_proj]", "optim.lr=1e-2", "optim.warmup_steps_ratio=0",
                    "optim.lr_scheduler=constant", "data.train_batch_size=4", "trainer.save_freq=2",
                    *extra)


def test_sft_with_lora_exports_and_resumes_as_an_uninterrupted_run(workspace, tmp_path):  # noqa: F811
    whole = tmp_path / "whole"
    assert ember_main(["sft", *sft_lora_args(workspace, whole, "trainer.total_training_steps=4")]) == 0
    losses = train_losses(whole)
    assert len(losses) == 4 and losses[-1] < losses[0]
    base = load_file(f"{workspace['model']}/model.safetensors")
    merged = load_file(str(whole / "hf_model" / "model.safetensors"))
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {f"model.layers.{layer}.self_attn.{module}.weight" for layer in (0, 1) for module in ("q_proj", "v_proj")}
    adapter = load_file(str(whole / "lora_adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 2

    parted = tmp_path / "parted"
    assert ember_main(["sft", *sft_lora_args(workspace, parted, "trainer.total_training_steps=2")]) == 0
    assert ember_main(["sft", *sft_lora_args(workspace, parted, "trainer.total_training_steps=4",
                                             "trainer.resume_mode=auto")]) == 0
    assert train_losses(parted) == losses
    resumed = load_file(str(parted / "lora_adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(resumed[name], tensor) for name, tensor in adapter.items())
