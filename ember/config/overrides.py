"""Command-line overrides in the Hydra grammar verl users type.

- `key=value` sets a key (inside a free-form mapping it may also add one);
- `+key=value` adds a key under a free-form mapping (on a schema key it simply sets it);
- `++key=value` sets or adds;
- `~key` deletes a key of a free-form mapping, or resets a schema key to its default;
- `group=option` / `group@package=option`, where the config folder holds `group/option.yaml`,
  picks that file for the group's entry of the defaults lists, and `+group=option` adds the
  group (`group_choices`; composed by compose.py).

Values are read as Hydra reads them: YAML for `[a, b]`, `{a: 1}`, `null`, `1e-6`, `'quoted'`;
other unquoted text is a string, spaces and colons included (`summary of the text: `). Where the schema wants a
plain string the text is kept as typed, so `trainer.experiment_name=0.10` stays `0.10`.
Overrides apply in order, so a repeated key takes its last value. Keys under `hydra.`
(Hydra's own settings, e.g. hydra.run.dir in verl scripts) have no meaning here and are skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from ember.config.compose import GroupChoice
from ember.config.errors import ConfigError
from ember.config.introspect import union_members
from ember.config.tree import ConfigTree, rewrite_alias
from ember.config.yaml_io import parse_yaml_value

_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(?P<assign>=(?P<value>.*))?$", re.DOTALL)


_GROUP_OVERRIDE = re.compile(r"^(?P<add>\+)?(?P<group>[\w\-]+(?:/[\w\-]+)*)(?:@(?P<package>[\w.]+))?=(?P<option>[\w.\-]+)$")


def group_choices(texts: list[str], config_dir: str | None) -> tuple[list[GroupChoice], list[GroupChoice], list[str]]:
    """Split overrides into group choices (`group=option`), group additions (`+group=option`) and the rest.

    An override is a group choice only where the config folder holds `group/option.yaml`."""
    choices, additions, rest = [], [], []
    for text in texts:
        match = _GROUP_OVERRIDE.match(text)
        root = config_dir if config_dir is not None else os.getcwd()
        if match is None or not os.path.isfile(os.path.join(root, match["group"], match["option"] + ".yaml")):
            rest.append(text)
            continue
        choice = GroupChoice(match["group"], match["package"], match["option"], f"override {text}")
        (additions if match["add"] else choices).append(choice)
    return choices, additions, rest


@dataclass(frozen=True)
class Override:
    """One parsed command-line override."""

    text: str  # as typed, for error messages
    prefix: str  # "", "+", "++" or "~"
    key: tuple[str, ...]
    raw_value: str | None  # the text after "=", None for "~key"


def parse_override(text: str) -> Override:
    """Split `text` into prefix, dotted key and value text; malformed text raises ConfigError."""
    match = _OVERRIDE.match(text)
    if match is None:
        raise ConfigError(f"cannot read override {text!r}; write key=value, +key=value, ++key=value or ~key")
    prefix = match["prefix"] or ""
    if prefix == "~" and match["assign"]:
        raise ConfigError(f"override {text!r}: ~key deletes a key and takes no value; write ~{match['key']}")
    if prefix != "~" and not match["assign"]:
        raise ConfigError(f"override {text!r} has no value; write {text}=VALUE (or ~{match['key']} to delete it)")
    return Override(text, prefix, tuple(match["key"].split(".")), match["value"])


def apply_override(tree: ConfigTree, override: Override) -> None:
    """Apply one override to `tree`; `hydra.*` keys configure Hydra itself and are skipped."""
    if override.key[0] == "hydra":
        return
    if override.prefix == "~":
        tree.remove(override.key)
        return
    key = rewrite_alias(tree.aliases, override.key)
    if tree.verl_key(key) is not None:
        tree.take_verl_key(key, _value(override, Any), f"override {override.text}")
        return
    location = tree.locate(key)
    tree.assign(override.key, _value(override, location.annotation))


def apply_overrides(tree: ConfigTree, texts: list[str]) -> None:
    """Parse and apply `texts` in order."""
    for text in texts:
        apply_override(tree, parse_override(text))


def _value(override: Override, annotation: Any) -> Any:
    try:
        value = parse_yaml_value(override.raw_value)
        if isinstance(value, (dict, list)) and not override.raw_value.lstrip().startswith(("{", "[")):
            return override.raw_value.strip()  # Hydra: unquoted text is one string (`a: b` and `- a` too)
    except yaml.YAMLError as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"cannot read the value of override {override.text!r} as YAML ({reason}); "
                          "quote it, e.g. key='...'") from None
    if not isinstance(value, (str, dict, list)) and value is not None and _wants_plain_string(annotation):
        return override.raw_value
    return value


def _wants_plain_string(annotation: Any) -> bool:
    """Whether the field holds a string (or null) and nothing else a YAML scalar could be."""
    members = set(union_members(annotation)) - {type(None)}
    return members == {str}
