"""Command-line overrides in the Hydra grammar verl users type.

- `key=value` sets a key (inside a free-form mapping it may also add one);
- `+key=value` adds a key under a free-form mapping (on a schema key it simply sets it);
- `++key=value` sets or adds;
- `~key` deletes a key of a free-form mapping, or resets a schema key to its default.

Values are read as YAML (`[a, b]`, `null`, `1e-6`, `'quoted'`). Where the schema wants a
plain string the text is kept as typed, so `trainer.experiment_name=0.10` stays `0.10`.
Overrides apply in order, so a repeated key takes its last value. Keys under `hydra.`
(Hydra's own settings, e.g. hydra.run.dir in verl scripts) have no meaning here and are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from ember.config.errors import ConfigError
from ember.config.introspect import union_members
from ember.config.tree import ConfigTree, rewrite_alias
from ember.config.yaml_io import parse_yaml_value

_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(?P<assign>=(?P<value>.*))?$", re.DOTALL)


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
