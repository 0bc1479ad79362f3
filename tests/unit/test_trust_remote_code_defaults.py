"""No code shipped inside a model folder runs unless the user asks: every root ember loads defaults
`trust_remote_code` to false, the NLA commands' own bases included."""

import pytest

from ember.config import load_config
from ember.config.schema.root import EmberConfig
from ember.config.schema.sft import SFTConfig
from ember.nla.commands import NLA_COMMANDS

NEEDED = {"extract": ["dataset.text_column=text"]}  # what a command refuses to load without (nothing about trust)


def trust_flags(cfg):
    """Every trust_remote_code a root carries, by key."""
    flags = {}
    for key in ("actor_rollout_ref.model", "critic.model", "reward_model.model", "data", "model"):
        section = cfg
        for part in key.split("."):
            section = getattr(section, part, None)
        if section is not None and hasattr(section, "trust_remote_code"):
            flags[f"{key}.trust_remote_code"] = section.trust_remote_code
    return flags


@pytest.mark.parametrize("command", sorted(NLA_COMMANDS))
def test_nla_commands_load_with_remote_code_off(command):
    nla = NLA_COMMANDS[command]
    cfg = load_config(NEEDED.get(command, []), config_name=nla.default_config, schema=nla.schema)
    flags = trust_flags(cfg)
    assert flags and not any(flags.values()), flags


def test_nla_train_base_turns_off_the_forks_trust_for_actor_and_critic():
    cfg = load_config([], config_name="nla_grpo_full", schema=NLA_COMMANDS["train"].schema)
    assert cfg.actor_rollout_ref.model.trust_remote_code is False
    assert cfg.critic.model.trust_remote_code is False


def test_user_turns_remote_code_on_explicitly():
    cfg = load_config(["actor_rollout_ref.model.trust_remote_code=true", "critic.model.trust_remote_code=true"],
                      config_name="nla_grpo_full", schema=NLA_COMMANDS["train"].schema)
    assert cfg.actor_rollout_ref.model.trust_remote_code and cfg.critic.model.trust_remote_code
    assert load_config(["model.trust_remote_code=true", *NEEDED["extract"]], config_name="nla_activation_dataset",
                       schema=NLA_COMMANDS["extract"].schema).model.trust_remote_code


@pytest.mark.parametrize("schema", [EmberConfig, SFTConfig])
def test_ember_roots_load_with_remote_code_off(schema):
    flags = trust_flags(load_config([], schema=schema))
    assert flags and not any(flags.values()), flags
