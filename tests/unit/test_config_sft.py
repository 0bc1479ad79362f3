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


def test_gradient_accumulation_must_agree_with_the_batch(tmp_path):
    # 16 GPUs / (TP 2 × PP 2) = 4 data-parallel ranks; 4 × 4 × 4 = 64 matches, 4 × 4 × 2 = 32 does not
    with pytest.raises(ConfigError) as error:
        load_sft(["trainer.nnodes=1", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT)
    message = str(error.value)
    assert "training.micro_batch_size_per_gpu" in message and "training.gradient_accumulation_steps" in message
    assert "= 4 × 4 × 2 = 32 does not equal data.train_batch_size=64" in message
    assert "training.gradient_accumulation_steps=8" in message


def test_sft_batch_must_split_into_micro_batches():
    with pytest.raises(ConfigError, match="use a batch size that is a multiple of 8"):
        load_sft(["trainer.n_gpus_per_node=2", "data.train_batch_size=12", "data.micro_batch_size_per_gpu=4"])


def test_sft_defaults_pass_and_megatron_is_refused_on_a_real_run(tmp_path):
    check_implemented(load_sft([]))
    cfg = load_sft(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"], tmp_path, MEGATRON_DIALECT)
    with pytest.raises(ConfigError) as error:
        check_implemented(cfg)
    assert "model.strategy=megatron is not implemented yet" in str(error.value)
    assert "use_remove_padding" not in str(error.value)  # packing is implemented


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
