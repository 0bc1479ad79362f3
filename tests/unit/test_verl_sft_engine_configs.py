"""verl's newer SFT trainer config (`sft_trainer_engine.yaml` with `model/`, `engine/`, `optim/` and `profiler/`
groups at the top level; tests/verl_sft_engine_configs/, real files of verl, see its README) loads under
`ember sft`: each key reaches the ember field of the same meaning, verl's keys without one are accepted at
verl's value and named otherwise."""

import logging
from pathlib import Path

import pytest

from ember.config import ConfigError, SFTConfig, load_config

VERL = str(Path(__file__).resolve().parents[1] / "verl_sft_engine_configs")


def verl_file(*overrides):
    return load_config(["model.path=/models/m", *overrides], config_path=VERL, config_name="sft_trainer_engine",
                       schema=SFTConfig)


def test_verls_sft_engine_file_reaches_embers_fields(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = verl_file()
    assert cfg.model.partial_pretrain == "/models/m"  # model.path
    assert cfg.use_remove_padding and cfg.ulysses_sequence_parallel_size == 1  # model/hf_model, engine/fsdp
    assert cfg.model.fsdp_config.model_dtype == "fp32" and cfg.model.strategy == "fsdp"
    assert (cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu) == (256, 4)
    assert cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu == 8192
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.9, 0.999] and cfg.optim.warmup_steps_ratio == 0.0
    assert cfg.optim.lr_scheduler == "constant" and cfg.trainer.seed == 1 and cfg.trainer.n_gpus_per_node == 1
    assert not [record for record in caplog.records if "verl keys" in record.getMessage()]  # all at verl's values


def test_the_newer_forms_command_line_keys_reach_the_same_fields():
    cfg = verl_file("engine.ulysses_sequence_parallel_size=2", "engine.param_offload=true", "optim.lr=2e-5",
                    "optim.lr_scheduler_type=cosine", "optim.lr_warmup_steps_ratio=0.1", "data.tools_key=tool_list",
                    "model.custom_chat_template='{{ messages }}'", "trainer.n_gpus_per_node=2")
    assert cfg.ulysses_sequence_parallel_size == 2 and cfg.model.fsdp_config.param_offload
    assert cfg.optim.lr == 2e-5 and cfg.optim.lr_scheduler == "cosine" and cfg.optim.warmup_steps_ratio == 0.1
    assert cfg.data.multiturn.tools_key == "tool_list" and cfg.data.chat_template == "{{ messages }}"


@pytest.mark.parametrize("override, message", [
    ("optim.warmup_style=cosine", "optim.warmup_style='cosine'.*write optim.lr_scheduler_type"),
    ("model.mtp={enable: true}", "model.mtp=.*multi-token prediction"),
    ("optim.min_lr_ratio=0.1", "optim.min_lr_ratio=0.1.*decays to 0"),
    ("model.override_config={attention_dropout: 0.1}", "model.override_config="),
])
def test_what_ember_would_run_otherwise_is_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        verl_file(override)


def test_verls_max_samples_keys_are_read():
    cfg = verl_file("data.train_max_samples=100", "data.val_max_samples=10")
    assert (cfg.data.train_max_samples, cfg.data.val_max_samples) == (100, 10)


def test_a_key_without_effect_is_named(caplog):
    with caplog.at_level(logging.WARNING):
        verl_file("model.use_fused_kernels=true")
    (message,) = [record.getMessage() for record in caplog.records if "verl keys" in record.getMessage()]
    assert "model.use_fused_kernels=True" in message


def test_the_built_in_base_of_that_name_carries_its_values():
    cfg = load_config(["model.path=/models/m"], config_name="sft_trainer_engine", schema=SFTConfig)
    assert cfg.model.partial_pretrain == "/models/m" and cfg.use_remove_padding and cfg.data.use_dynamic_bsz
    assert cfg.optim.lr == 1e-3 and cfg.optim.lr_scheduler == "constant" and cfg.optim.betas == [0.9, 0.999]


def test_full_determinism_reaches_the_fsdp_settings_in_both_forms():
    from ember.config import EmberConfig

    assert verl_file("engine.full_determinism=true").model.fsdp_config.full_determinism
    rl = load_config(["actor_rollout_ref.actor.fsdp_config.full_determinism=true",
                      "actor_rollout_ref.actor.fsdp_config.seed=7"], schema=EmberConfig)
    assert rl.actor_rollout_ref.actor.fsdp_config.full_determinism  # verl's seed key: accepted (trainer.seed seeds)
