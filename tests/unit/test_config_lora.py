"""LoRA's keys at load time (`config/lora_rules.py`) and against the model (`trainer/lora_setup.py`): each
refusal names the key to change; verl's use_shm and layered_summon are accepted and named as without effect."""

import logging

import pytest

from ember.config import ConfigError, SFTConfig, load_config
from ember.errors import UserError
from ember.models.tiny import tiny_model_config
from ember.trainer.lora_setup import check_lora_model, lora_options

A = "actor_rollout_ref"


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.model.lora_rank=8", f"{A}.model.lora_alpha=0"], f"{A}.model.lora_alpha=0.0: LoRA scales"),
    ([f"{A}.model.lora_rank=8", f"{A}.actor.strategy=megatron", f"{A}.rollout.name=ember"],
     f"{A}.model.lora_rank=8 with {A}.actor.strategy=megatron: ember's LoRA (PEFT's modules) runs on FSDP2 only"),
    ([f"{A}.model.lora_adapter_path=/adapter"], f"{A}.model.lora_adapter_path is set but {A}.model.lora_rank=0"),
    ([f"{A}.model.lora_rank=8", f"{A}.model.target_modules=q_proj"], f"{A}.model.target_modules=q_proj: write all-linear"),
    ([f"{A}.model.lora_rank=8", f"{A}.model.target_modules=[]"], f"{A}.model.target_modules is an empty list"),
])
def test_rl_lora_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides)


def test_sft_lora_keys_are_refused_by_name():
    with pytest.raises(ConfigError, match="model.lora_alpha=-1.0"):
        load_config(["model.lora_rank=4", "model.lora_alpha=-1"], schema=SFTConfig)
    with pytest.raises(ConfigError, match="model.lora_rank=4 with model.strategy=megatron"):
        load_config(["model.lora_rank=4", "model.strategy=megatron"], schema=SFTConfig)


def test_target_names_are_checked_against_the_models_linear_layers(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model_config("qwen2", vocab_size=64).save_pretrained(model_dir)  # its config is all the check reads
    cfg = load_config([f"{A}.model.lora_rank=8", f"{A}.model.target_modules=[q_proj,qkv_proj]",
                       f"{A}.model.exclude_modules=[lm_head]"])
    with pytest.raises(UserError, match=f"{A}.model.target_modules: qkv_proj is not a linear layer of Qwen2ForCausalLM; "
                                        "its linear layers are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj"):
        check_lora_model(lora_options(cfg.actor_rollout_ref.model, f"{A}.model"), str(model_dir), False)
    cfg = load_config([f"{A}.model.lora_rank=8", f"{A}.model.exclude_modules=[lm_head]"])
    with pytest.raises(UserError, match=f"{A}.model.exclude_modules: lm_head is not a linear layer"):
        check_lora_model(lora_options(cfg.actor_rollout_ref.model, f"{A}.model"), str(model_dir), False)
    cfg = load_config([f"{A}.model.lora_rank=8", f"{A}.model.lora_adapter_path={tmp_path}"])
    with pytest.raises(UserError, match=f"{A}.model.lora_adapter_path={tmp_path} is not a PEFT adapter folder"):
        check_lora_model(lora_options(cfg.actor_rollout_ref.model, f"{A}.model"), str(model_dir), False)


def test_use_shm_and_layered_summon_are_accepted_and_named_as_without_effect(caplog):
    with caplog.at_level(logging.WARNING):
        load_config([f"{A}.model.use_shm=true", f"{A}.rollout.layered_summon=true"])
    assert f"{A}.model.use_shm" in caplog.text and f"{A}.rollout.layered_summon" in caplog.text
    assert "with LoRA sends only the adapted layers" in caplog.text
