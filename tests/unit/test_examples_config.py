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
