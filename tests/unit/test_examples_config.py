"""The example configs users copy load as written and run on the fast path."""

from pathlib import Path

from ember.config import check_implemented, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_addition"


def test_the_smollm2_example_loads_and_uses_embers_engine_and_the_speed_switches(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_DATA", str(tmp_path))
    cfg = load_config([], config_path=str(EXAMPLE), config_name="config")
    check_implemented(cfg)
    arr = cfg.actor_rollout_ref
    assert arr.rollout.engine == "ember"
    assert arr.model.use_remove_padding and arr.model.use_fused_kernels and arr.actor.use_dynamic_bsz
    assert cfg.data.train_files == f"{tmp_path}/train.parquet"


def test_the_aqn_variant_adds_noise_to_the_same_run(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_DATA", str(tmp_path))
    base = load_config([], config_path=str(EXAMPLE), config_name="config")
    aqn = load_config([], config_path=str(EXAMPLE), config_name="config_aqn")
    check_implemented(aqn)
    assert aqn.trainer.noise_injection.enabled and not base.trainer.noise_injection.enabled
    assert aqn.actor_rollout_ref.rollout.engine == "ember"
    assert aqn.data.train_batch_size == base.data.train_batch_size and aqn.trainer.seed == base.trainer.seed


def test_the_lora_variant_trains_an_adapter_on_the_same_run(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_DATA", str(tmp_path))
    base = load_config([], config_path=str(EXAMPLE), config_name="config")
    lora = load_config([], config_path=str(EXAMPLE), config_name="config_lora")
    check_implemented(lora)
    model = lora.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (32, 64, "all-linear")
    assert base.actor_rollout_ref.model.lora_rank == 0
    assert lora.actor_rollout_ref.rollout.engine == "ember" and lora.trainer.seed == base.trainer.seed
    assert lora.data.train_batch_size == base.data.train_batch_size
    assert lora.trainer.total_training_steps == base.trainer.total_training_steps
