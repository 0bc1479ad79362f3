"""`load_config`: from config files and command-line overrides to one typed, validated configuration.

The order is: schema defaults, then the layers of `--config-name` (its `defaults:` list,
see compose.py), then the overrides in the order given; verl's keys without an ember field
are refused or named once (verl_keys.py); then `${...}` interpolations are
resolved (OmegaConf), values are type-checked into the schema dataclasses, implied values
are filled (normalize.py) and the whole is validated (validate.py). Every step raises
ConfigError with a message for the user.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ember.config.coerce import build
from ember.config.compose import compose_layers
from ember.config.errors import ConfigError
from ember.config.normalize import normalize
from ember.config.overrides import apply_overrides, group_choices
from ember.config.schema import EmberConfig
from ember.config.tree import ConfigTree
from ember.config.validate import validate
from ember.config.yaml_io import dump_yaml

Config = TypeVar("Config")
logger = logging.getLogger(__name__)


def load_config(argv_overrides: list[str], config_path: str | None = None, config_name: str | None = None,
                schema: type[Config] = EmberConfig) -> Config:
    """The validated configuration of root dataclass `schema` from a config file and overrides."""
    if config_path is not None and config_name is None:
        raise ConfigError("--config-path needs --config-name (the YAML file inside that folder, without .yaml)")
    tree = ConfigTree(schema)
    if config_name is not None:
        choices, additions, argv_overrides = group_choices(argv_overrides, config_path)
        for layer in compose_layers(config_path, config_name, schema.builtin_bases, tuple(choices), tuple(additions),
                                    getattr(schema, "implicit_base", None)):
            tree.merge(layer.data, layer.source)
    apply_overrides(tree, argv_overrides)
    check_verl_keys(tree)
    cfg = build(schema, resolve_interpolations(tree.values))
    normalize(cfg)
    validate(cfg)
    return cfg


def check_verl_keys(tree: ConfigTree) -> None:
    """Refuse verl's keys whose value ember cannot honour; name once those whose value has no effect here."""
    if tree.verl_refusals:
        raise ConfigError("verl keys that ember does not run as verl does; remove them or set verl's default:\n  "
                          + "\n  ".join(tree.verl_refusals.values()))
    if tree.verl_notes:
        logger.warning("verl keys with no effect in ember (accepted, not used):\n  %s",
                       "\n  ".join(tree.verl_notes.values()))


def resolve_interpolations(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every `${a.b}` replaced by the value it points to."""
    try:
        return OmegaConf.to_container(OmegaConf.create(values), resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(f"cannot resolve an interpolation: {error}") from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A typed configuration as plain nested dicts and lists (what YAML prints)."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Any) -> str:
    """A typed configuration as YAML that `load_config` reads back to an equal configuration."""
    return dump_yaml(config_to_dict(cfg))
