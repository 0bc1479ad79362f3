"""Numbers that every range check lets through are refused at load time (`config/numbers.py`):
NaN and infinity in any float key, integers past 64 bits, seeds torch cannot take, and token
lengths, batches or GPU counts no machine can allocate."""

import dataclasses

import pytest

from ember.config import ConfigError, EmberConfig, SFTConfig, load_config
from ember.config.introspect import field_types, union_members
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_train import NLATrainConfig


def float_keys(section, prefix=""):
    """Every float key of a loaded configuration (lists of floats by their first item), sections that are null skipped."""
    keys = []
    for name, annotation in field_types(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            keys += float_keys(value, f"{prefix}{name}.")
        elif (float in union_members(annotation) or annotation == list[float]) and not prefix.startswith(
                "actor_rollout_ref.nla."):  # the NLA base's `${nla}`: the same values as nla.*
            keys.append(f"{prefix}{name}")
    return keys


def refused(overrides, schema=EmberConfig, **where) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(overrides, schema=schema, **where)
    return str(raised.value)


@pytest.mark.parametrize("schema, where", [
    (EmberConfig, {}), (SFTConfig, {}), (NLATrainConfig, {"config_name": "nla_grpo_full"}),
    (NLAExtractConfig, {"config_name": "nla_activation_dataset"}),
])
@pytest.mark.parametrize("spelling, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("1e999", "inf")])
def test_every_float_key_refuses_nan_and_infinity(schema, where, spelling, shown):
    required = ["dataset.text_column=text"] if schema is NLAExtractConfig else []
    keys = float_keys(load_config(required, schema=schema, **where))
    assert keys
    overrides = [f"{key}=[{spelling}]" if key.endswith("betas") else f"{key}={spelling}" for key in keys]
    message = refused(required + overrides, schema, **where)
    for key in keys:
        shown_key = f"{key}[0]" if key.endswith("betas") else key
        assert f"{shown_key}={shown}: must be a finite number" in message


@pytest.mark.parametrize("override", [
    "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.grad_clip",
    "reward_model.timeout_s", "trainer.max_loss_or_grad_norm", "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p", "algorithm.gamma", "algorithm.lam", "algorithm.kl_ctrl.kl_coef",
    "reward_model.failure_score"])
def test_one_nan_is_refused_alone_with_its_key(override):
    assert refused([f"{override}=.nan"]) == f"{override}=nan: must be a finite number"


def test_sft_lr_and_warmup_ratio_refuse_nan():
    message = refused(["optim.lr=.nan", "optim.warmup_steps_ratio=.inf"], SFTConfig)
    assert "optim.lr=nan: must be a finite number" in message
    assert "optim.warmup_steps_ratio=inf: must be a finite number" in message


@pytest.mark.parametrize("key", ["data.seed", "trainer.seed", "actor_rollout_ref.rollout.seed"])
@pytest.mark.parametrize("value", [-1, 2**64])
def test_seeds_must_be_what_torch_takes(key, value):
    assert refused([f"{key}={value}"]) == f"{key}={value}: a seed must be in [0, 2**64 - 1] (what torch takes)"


def test_the_largest_seed_torch_takes_loads():
    assert load_config([f"trainer.seed={2**64 - 1}", "data.seed=0"]).trainer.seed == 2**64 - 1


def test_sft_seed_is_checked_too():
    assert "trainer.seed=-3: a seed must be in" in refused(["trainer.seed=-3"], SFTConfig)


@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.rollout.n=12345678901234567890"],
     "actor_rollout_ref.rollout.n=12345678901234567890: too large; give a number below 2**63"),
    (["actor_rollout_ref.rollout.n=1e25"], "actor_rollout_ref.rollout.n=10000000000000000905969664: too large"),
    (["actor_rollout_ref.rollout.n=100000"],
     "data.train_batch_size × actor_rollout_ref.rollout.n = 1024 × 100000 = 102400000 responses in one batch cannot be "
     "allocated: give at most 16,777,216"),
    (["data.max_response_length=1e8"],
     "data.max_response_length=100000000 tokens cannot be allocated: give at most 16,777,216"),
    (["trainer.n_gpus_per_node=1000000000000", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=7"],
     "trainer.nnodes × trainer.n_gpus_per_node = 1 × 1000000000000 GPUs: give at most 1,048,576"),
])
def test_absurd_sizes_are_refused_before_any_arithmetic(overrides, expected):
    assert expected in refused(overrides)


def test_sft_batch_and_length_limits():
    message = refused(["data.max_length=1e9", "data.train_batch_size=1e9"], SFTConfig)
    assert "data.max_length=1000000000 tokens cannot be allocated" in message
    assert "data.train_batch_size=1000000000 examples in one batch cannot be allocated" in message


def test_suggested_divisors_of_a_large_count_come_at_once():
    from ember.config.parallel import nearest_divisors

    assert nearest_divisors(2**40, 3) == [1, 2, 4]
    assert nearest_divisors(1_000_003 * 1_000_033, 1000) == [1, 1_000_003, 1_000_033]


@pytest.mark.parametrize("command, override, message", [
    ("sft", "optim.lr=.nan", "error: optim.lr=nan: must be a finite number"),
    ("sft", "optim.warmup_steps_ratio=.inf", "error: optim.warmup_steps_ratio=inf: must be a finite number"),
    ("train", "data.seed=-1", "error: data.seed=-1: a seed must be in [0, 2**64 - 1]"),
])
def test_the_commands_exit_2_with_the_message(capsys, command, override, message):
    from ember.cli import main

    assert main([command, override, "--print-config"]) == 2
    assert message in capsys.readouterr().err
