"""Loading: YAML files with Hydra defaults lists, interpolation, the override grammar, unknown keys."""

import textwrap

import pytest

from ember.config import ConfigError, EmberConfig, SFTConfig, config_to_dict, config_to_yaml, field_description, load_config
from ember.config.schema.megatron import MegatronConfig


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_follow_verl_and_resolve_interpolations():
    cfg = load_config([])
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length == 512
    assert cfg.critic.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["model", "optimizer", "extra"]
    assert cfg.trainer.default_local_dir == "checkpoints/ember/default"


def test_followed_values_track_what_they_follow():
    cfg = load_config(["data.max_prompt_length=300", "actor_rollout_ref.actor.clip_ratio=0.3",
                       "actor_rollout_ref.actor.clip_ratio_high=0.28", "trainer.project_name=p", "trainer.experiment_name=e",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"])
    assert cfg.actor_rollout_ref.rollout.prompt_length == 300
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.3  # follows clip_ratio
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28  # set by the user
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"


def test_config_name_with_slashes_and_optional_suffix(tmp_path):
    write(tmp_path / "runs/qwen_7b/rl_grpo.yaml", """
        algorithm: {adv_estimator: grpo}
        data: {train_batch_size: 64}
        actor_rollout_ref:
          actor: {ppo_mini_batch_size: 16, optim: {lr: 1e-6}}
          rollout: {n: 4}
    """)
    for name in ("runs/qwen_7b/rl_grpo", "runs/qwen_7b/rl_grpo.yaml"):
        cfg = load_config([], config_path=str(tmp_path), config_name=name)
        assert cfg.data.train_batch_size == 64
        assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
        assert cfg.actor_rollout_ref.rollout.n == 4


def test_overrides_apply_after_the_file(tmp_path):
    write(tmp_path / "run.yaml", "actor_rollout_ref: {rollout: {n: 4}}\n")
    cfg = load_config(["actor_rollout_ref.rollout.n=2"], config_path=str(tmp_path), config_name="run")
    assert cfg.actor_rollout_ref.rollout.n == 2


def test_defaults_list_merges_bases_in_order_and_self_last_by_default(tmp_path):
    write(tmp_path / "common.yaml", """
        trainer: {project_name: from_common, experiment_name: common_exp}
        data: {train_batch_size: 512}
    """)
    write(tmp_path / "runs/a.yaml", """
        hydra: {searchpath: ['file://verl/trainer/config']}
        defaults: [ppo_megatron_trainer, common]
        trainer: {project_name: from_self}
    """)
    write(tmp_path / "runs/b.yaml", """
        defaults: [_self_, common]
        trainer: {project_name: from_self}
    """)
    first = load_config([], config_path=str(tmp_path), config_name="runs/a")
    assert first.trainer.project_name == "from_self"  # _self_ comes last when not listed
    assert first.trainer.experiment_name == "common_exp"
    assert first.data.train_batch_size == 512
    assert first.actor_rollout_ref.actor.strategy == "megatron"  # the built-in base
    assert first.critic.strategy == "megatron"
    second = load_config([], config_path=str(tmp_path), config_name="runs/b")
    assert second.trainer.project_name == "from_common"  # _self_ first, so common wins


def test_defaults_group_entry_is_placed_under_its_package(tmp_path):
    write(tmp_path / "actor/big_lr.yaml", "optim: {lr: 3e-5}\n")
    write(tmp_path / "run.yaml", "defaults: [{actor@actor_rollout_ref.actor: big_lr}, _self_]\n")
    cfg = load_config([], config_path=str(tmp_path), config_name="run")
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-5


def test_defaults_entry_that_includes_itself_is_an_error(tmp_path):
    write(tmp_path / "loop.yaml", "defaults: [loop]\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config([], config_path=str(tmp_path), config_name="loop")


def test_missing_file_and_path_without_name_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([], config_path=str(tmp_path), config_name="nope")
    with pytest.raises(ConfigError, match="--config-path needs --config-name"):
        load_config([], config_path=str(tmp_path))


def test_user_interpolations_in_files_and_overrides(tmp_path):
    write(tmp_path / "run.yaml", """
        critic: {optim: {lr: '${actor_rollout_ref.actor.optim.lr}'}}
        trainer: {experiment_name: 'bs${data.train_batch_size}'}
    """)
    cfg = load_config(["actor_rollout_ref.actor.optim.lr=2e-6", "trainer.default_local_dir=/out/${trainer.experiment_name}"],
                      config_path=str(tmp_path), config_name="run")
    assert cfg.critic.optim.lr == 2e-6
    assert cfg.trainer.experiment_name == "bs1024"
    assert cfg.trainer.default_local_dir == "/out/bs1024"
    with pytest.raises(ConfigError, match="interpolation"):
        load_config(["trainer.experiment_name=${data.no_such_key}"])


def test_plus_adds_under_free_form_mapping_and_tilde_removes():
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    cfg = load_config([f"+{key}.recompute_num_layers=1", f"+{key}.recompute_method=uniform", f"++{key}.recompute_granularity=full"])
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {
        "recompute_num_layers": 1, "recompute_method": "uniform", "recompute_granularity": "full"}
    cfg = load_config([f"+{key}.recompute_num_layers=1", f"+{key}.recompute_method=uniform", f"~{key}.recompute_num_layers"])
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {"recompute_method": "uniform"}
    with pytest.raises(ConfigError, match="not set"):
        load_config([f"~{key}.recompute_num_layers"])


def test_plain_assignment_reaches_into_free_form_defaults():
    cfg = load_config(["actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=32", "data.reward_fn={_target_: my.fn, scale: 2}"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"vllm": {"swap_space": 32}, "sglang": {}}
    assert cfg.data.reward_fn == {"_target_": "my.fn", "scale": 2}


def test_tilde_resets_a_schema_key_and_an_optional_section(tmp_path):
    write(tmp_path / "run.yaml", "actor_rollout_ref: {rollout: {n: 4, temperature: 0.7}}\n")
    cfg = load_config(["~actor_rollout_ref.rollout.n"], config_path=str(tmp_path), config_name="run")
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7
    cfg = load_config(["model.megatron.tensor_model_parallel_size=2", "~model.megatron"], schema=SFTConfig)
    assert cfg.model.megatron is None


@pytest.mark.parametrize("section", ["actor_rollout_ref.actor", "actor_rollout_ref.rollout", "data"])
def test_tilde_on_a_section_every_run_needs_names_it_instead_of_resetting_it(section, tmp_path):
    write(tmp_path / "run.yaml", "actor_rollout_ref: {rollout: {n: 4, temperature: 0.7}}\n")
    with pytest.raises(ConfigError, match=rf"^cannot remove {section}: every run needs this section; reset the keys "
                                          rf"you changed one by one \(~{section}.KEY\)"):
        load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"~{section}"],
                    config_path=str(tmp_path), config_name="run")


def test_hydra_settings_are_skipped():
    assert load_config(["hydra.run.dir=/tmp/x", "++hydra.job.chdir=false"]) == load_config([])


def test_repeated_key_keeps_the_last_value():
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n=8"])
    assert cfg.actor_rollout_ref.rollout.n == 8


@pytest.mark.parametrize("override, path, expected", [
    ("trainer.logger=['console','tensorboard']", "trainer.logger", ["console", "tensorboard"]),
    ("trainer.logger=console", "trainer.logger", ["console"]),
    ("data.val_files=null", "data.val_files", None),
    ("data.train_files=[a.parquet, b.parquet]", "data.train_files", ["a.parquet", "b.parquet"]),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr", 1e-6),
    ("actor_rollout_ref.actor.optim.lr=3.0E-5", "actor_rollout_ref.actor.optim.lr", 3e-5),
    ("actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.entropy_coeff", 0.0),
    ("data.shuffle=False", "data.shuffle", False),
    ("data.shuffle=true", "data.shuffle", True),
    ("trainer.experiment_name='123'", "trainer.experiment_name", "123"),
    ("trainer.experiment_name=0.10", "trainer.experiment_name", "0.10"),
    ("trainer.experiment_name=yes", "trainer.experiment_name", "yes"),
    ("trainer.experiment_name=", "trainer.experiment_name", ""),
    ("data.max_prompt_length=1e3", "data.max_prompt_length", 1000),
    ("actor_rollout_ref.actor.optim.betas=[0.9, 0.95]", "actor_rollout_ref.actor.optim.betas", [0.9, 0.95]),
])
def test_values_are_read_as_yaml(override, path, expected):
    value = load_config([override])
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


def test_unknown_key_suggests_sibling():
    with pytest.raises(ConfigError) as error:
        load_config(["actor_rollout_ref.actor.ppo_mini_batch=16"])
    assert str(error.value).startswith("unknown key actor_rollout_ref.actor.ppo_mini_batch; did you mean ppo_mini_batch_size")


def test_unknown_key_suggests_the_right_place_for_a_misplaced_key():
    with pytest.raises(ConfigError) as error:
        load_config(["actor_rollout_ref.ppo_mini_batch_size=16"])
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size or critic.ppo_mini_batch_size?" in str(error.value)
    with pytest.raises(ConfigError, match=r"did you mean actor_rollout_ref\.actor\.use_kl_loss\?"):
        load_config(["+critic.use_kl_loss=true"])


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = write(tmp_path / "runs/bad.yaml", "trainer:\n  n_gpu_per_node: 8\n")
    with pytest.raises(ConfigError) as error:
        load_config([], config_path=str(tmp_path), config_name="runs/bad")
    message = str(error.value)
    assert f"unknown key trainer.n_gpu_per_node in {path}" in message
    assert "did you mean n_gpus_per_node" in message


def test_keys_below_a_value_or_a_section_given_a_value_are_errors():
    with pytest.raises(ConfigError, match="data.train_batch_size is a value, not a section"):
        load_config(["data.train_batch_size.x=1"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim is a section"):
        load_config(["actor_rollout_ref.actor.optim=3"])


def test_malformed_overrides_say_how_to_write_them():
    with pytest.raises(ConfigError, match="has no value"):
        load_config(["data.train_batch_size"])
    with pytest.raises(ConfigError, match="takes no value"):
        load_config(["~data.train_batch_size=4"])
    with pytest.raises(ConfigError, match="quote it"):
        load_config(["trainer.experiment_name=[unclosed"])


def test_printed_yaml_loads_back_to_an_equal_config(tmp_path):
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-6",
                       "trainer.experiment_name=0.10", "+actor_rollout_ref.model.override_config.rope_theta=1e6"])
    (tmp_path / "printed.yaml").write_text(config_to_yaml(cfg))
    assert load_config([], config_path=str(tmp_path), config_name="printed") == cfg
    assert config_to_dict(cfg)["actor_rollout_ref"]["model"]["override_config"] == {"rope_theta": 1e6}


def test_every_field_has_a_description():
    assert field_description(MegatronConfig, "tensor_model_parallel_size").startswith("tensor parallel (TP) size")
    with pytest.raises(KeyError, match="no field 'tp'"):
        field_description(MegatronConfig, "tp")
    from ember.config.describe import describe_keys
    lines = describe_keys(EmberConfig).splitlines()
    assert len(lines) > 300
    assert all("  # " in line and not line.endswith("# ") for line in lines)


def test_a_file_named_like_a_builtin_base_shadows_it(tmp_path):
    write(tmp_path / "ppo_trainer.yaml", "trainer: {project_name: mine}\n")
    write(tmp_path / "run.yaml", "defaults: [ppo_trainer, _self_]\n")
    assert load_config([], config_path=str(tmp_path), config_name="run").trainer.project_name == "mine"
    assert load_config([], config_path=str(tmp_path), config_name="ppo_trainer").trainer.project_name == "mine"
    assert load_config([], config_path=str(tmp_path), config_name="ppo_megatron_trainer").actor_rollout_ref.actor.strategy == "megatron"
