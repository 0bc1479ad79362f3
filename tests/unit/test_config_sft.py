"""`ember sft` configuration in verl's sft_trainer keys and in the Megatron-style dialect."""

import textwrap

import pytest

from ember.config import ConfigError, SFTConfig, check_implemented, load_config

MEGATRON_DIALECT = """
model:
  partial_pretrain: /path/to/hf/model
  enable_gradient_checkpointing: true
  megatron: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2, virtual_pipeline_model_parallel_size: 2, use_distributed_optimizer: true}
training: {micro_batch_size_per_gpu: 4, gradient_accumulation_steps: 4, use_rmpad: true}
data: {train_files: [train.parquet], val_files: [val.parquet], train_batch_size: 64, sequence_length: 2048}
"""


def load_sft(overrides, tmp_path=None, text=None):
    if text is None:
        return load_config(overrides, schema=SFTConfig)
    (tmp_path / "sft.yaml").write_text(textwrap.dedent(text))
    return load_config(overrides, config_path=str(tmp_path), config_name="sft", schema=SFTConfig)


def test_verl_sft_trainer_keys():
    cfg = load_sft(["data.train_files=/d/train.parquet", "data.val_files=/d/test.parquet", "data.prompt_key=extra_info",
                    "data.response_key=extra_info", "data.multiturn.enable=true", "data.messages_key=conversation",
                    "data.max_length=4096", "data.truncation=right", "data.train_batch_size=32", "data.micro_batch_size_per_gpu=4",
                    "model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct", "model.enable_gradient_checkpointing=False",
                    "model.strategy=fsdp2", "model.fsdp_config.param_offload=true", "model.trust_remote_code=true",
                    "model.lora_rank=0", "model.use_liger=False", "optim.lr=1e-4", "optim.betas=[0.9,0.95]", "optim.weight_decay=0.01",
                    "optim.warmup_steps_ratio=0.05", "optim.clip_grad=1.0", "optim.lr_scheduler=cosine", "use_remove_padding=false",
                    "trainer.default_local_dir=/ckpt/sft", "trainer.project_name=gsm8k-sft", "trainer.experiment_name=qwen05",
                    "trainer.total_epochs=2", "trainer.total_training_steps=100", "trainer.logger=['console']", "trainer.seed=7",
                    "trainer.save_freq=50", "trainer.test_freq=10", "trainer.nnodes=1", "trainer.n_gpus_per_node=8",
                    "trainer.max_ckpt_to_keep=2", "trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/sft/step_50"])
    assert cfg.data.multiturn.messages_key == "conversation"  # data.messages_key is an alias
    assert cfg.data.max_length == 4096 and cfg.data.truncation == "right"
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == [0.9, 0.95]
    assert cfg.model.strategy == "fsdp2"
    assert cfg.trainer.max_ckpt_to_keep == 2


def test_megatron_dialect_maps_onto_verl_keys(tmp_path):
    cfg = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT)
    assert cfg.data.micro_batch_size_per_gpu == 4
    assert cfg.data.max_length == 2048
    assert cfg.use_remove_padding is True
    assert cfg.training.gradient_accumulation_steps == 4
    assert cfg.model.strategy == "megatron"  # chosen because model.megatron is given
    assert cfg.model.megatron.virtual_pipeline_model_parallel_size == 2
    assert cfg.model.megatron.context_parallel_size == 1  # the rest of the section keeps its defaults
    assert cfg.data.train_files == ["train.parquet"]


def test_a_gradient_accumulation_that_disagrees_is_derived_from_the_batch_with_a_warning(tmp_path):
    from ember.config.validate import sft_accumulation_note

    # 8 GPUs / (TP 2 × PP 2) = 2 data-parallel ranks: 64 = 4 × 2 × 8, so the dialect's 4 is not what runs
    cfg = load_sft(["trainer.nnodes=1", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT)
    assert sft_accumulation_note(cfg) == (
        "training.gradient_accumulation_steps=4 disagrees with data.train_batch_size=64 = micro-batch 4 × "
        "data-parallel size 2 × accumulation 8; using 8 (verl's meaning: train_batch_size is the global batch of "
        "one optimizer step)")
    agreeing = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT)  # 4 × 4 × 4
    assert sft_accumulation_note(agreeing) is None


def test_python_none_on_the_command_line_is_null_for_a_nullable_key(tmp_path):
    cfg = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                    "model.megatron.virtual_pipeline_model_parallel_size=None"], tmp_path, MEGATRON_DIALECT)
    assert cfg.model.megatron.virtual_pipeline_model_parallel_size is None
    with pytest.raises(ConfigError, match="expected an integer"):
        load_sft(["data.train_batch_size=None"])


def test_sft_batch_must_split_into_micro_batches():
    with pytest.raises(ConfigError, match="use a batch size that is a multiple of 8"):
        load_sft(["trainer.n_gpus_per_node=2", "data.train_batch_size=12", "data.micro_batch_size_per_gpu=4"])


def test_sft_defaults_and_the_megatron_dialect_pass_but_megatron_offload_is_refused(tmp_path):
    check_implemented(load_sft([]))
    check_implemented(load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT))
    cfg = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "model.megatron.optimizer_offload=true"],
                   tmp_path, MEGATRON_DIALECT)
    with pytest.raises(ConfigError, match="model.megatron.optimizer_offload=true is not implemented yet"):
        check_implemented(cfg)


def test_alias_and_its_target_given_together_keep_the_later():
    cfg = load_sft(["data.max_length=512", "data.sequence_length=1024"])
    assert cfg.data.max_length == 1024


def test_sft_unknown_key_and_rl_only_base():
    with pytest.raises(ConfigError, match="did you mean micro_batch_size_per_gpu"):
        load_sft(["data.micro_batch_size_per_gp=4"])
    with pytest.raises(ConfigError, match="unknown key actor_rollout_ref"):
        load_sft(["actor_rollout_ref.rollout.n=4"])


def test_tilde_resets_a_key_of_an_optional_section_to_its_class_default(tmp_path):
    cfg = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "~model.megatron.virtual_pipeline_model_parallel_size",
                    "~model.megatron.tensor_model_parallel_size", "training.gradient_accumulation_steps=2"], tmp_path, MEGATRON_DIALECT)
    assert cfg.model.megatron.tensor_model_parallel_size == 1
    assert cfg.model.megatron.virtual_pipeline_model_parallel_size is None
    assert cfg.model.megatron.pipeline_model_parallel_size == 2


def test_token_budget_micro_batches_replace_the_count_arithmetic():
    # 102 is no multiple of micro-batch 4; with a token budget only the data-parallel split matters.
    assert load_sft(["data.train_batch_size=102", "data.use_dynamic_bsz=true"]).data.use_dynamic_bsz
    with pytest.raises(ConfigError, match="gradient_accumulation_steps.*use_dynamic_bsz"):
        load_sft(["data.use_dynamic_bsz=true", "training.gradient_accumulation_steps=4"])
    with pytest.raises(ConfigError, match="max_token_len_per_gpu"):
        load_sft(["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=0"])


def test_liger_kernels_are_taken_by_sft_and_reach_its_engine(monkeypatch):
    """`model.use_liger` is implemented for `ember sft` (FSDP2), and the engine it builds gets the switch."""
    import ember.trainer.sft as sft

    cfg = load_sft(["model.use_liger=true"])
    check_implemented(cfg)
    seen = {}
    monkeypatch.setattr(sft, "build_engine", lambda *args, **kwargs: seen.update(kwargs))
    trainer = object.__new__(sft.SFTTrainer)
    trainer.cfg, trainer.total_steps = cfg, 10
    trainer.build_engine()
    assert seen["use_liger"] is True
