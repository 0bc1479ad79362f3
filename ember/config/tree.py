"""The configuration as a plain nested dict, changed only through schema-checked operations.

`ConfigTree` starts from the schema defaults and takes YAML layers (`merge`) and
command-line overrides (`assign`, `remove`). Every key is checked against the schema as it
arrives, so an unknown key is reported with the file or override it came from. Values stay
as written (interpolations included) until the loader resolves and type-checks them. A key
the schema lacks but verl's own files write (`_target_`, ember/config/verl_keys.py) is taken
off as it arrives: quietly at verl's default, else kept in `verl_notes` or `verl_refusals`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ember.config.errors import ConfigError
from ember.config.introspect import KeyLocation, UnknownKey, locate, section_class, union_members
from ember.config.suggest import unknown_key_message
from ember.config.verl_keys import VerlKey

HYDRA_TARGET = "_target_"  # the class Hydra would instantiate a section as (verl's files name their dataclasses)


def defaults_tree(schema: type) -> dict[str, Any]:
    """The schema defaults of `schema` as a nested dict (interpolations unresolved)."""
    return dataclasses.asdict(schema())


def is_interpolation(value: Any) -> bool:
    """Whether `value` is one `${...}` reference (resolved by the loader), e.g. the fork's `actor_rollout_ref.nla: ${nla}`."""
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def rewrite_alias(aliases: dict[str, str], parts: tuple[str, ...]) -> tuple[str, ...]:
    """`parts` with a leading alias (a dialect's name for a key) replaced by the key it means."""
    for length in range(len(parts), 0, -1):
        canonical = aliases.get(".".join(parts[:length]))
        if canonical is not None:
            return tuple(canonical.split(".")) + parts[length:]
    return parts


class ConfigTree:
    """A nested dict of configuration values for the root dataclass `schema`."""

    def __init__(self, schema: type):
        self.schema = schema
        self.aliases: dict[str, str] = schema.key_aliases
        self.defaults = defaults_tree(schema)
        self.values = copy.deepcopy(self.defaults)
        self.verl_keys: dict[str, VerlKey] = getattr(schema, "verl_keys", {})
        self.verl_notes: dict[str, str] = {}  # key -> why the value given has no effect in ember
        self.verl_refusals: dict[str, str] = {}  # key -> why the value given cannot run in ember

    def verl_key(self, parts: tuple[str, ...]) -> tuple[str, VerlKey | None, tuple[str, ...]] | None:
        """Where `parts` is a key ember has no field for but verl writes: the listed key, its entry (None for
        `_target_`) and the rest of `parts` below it. None for any other key."""
        try:
            locate(self.schema, parts)
            return None
        except UnknownKey as unknown:
            if HYDRA_TARGET in parts[unknown.bad_index:]:
                return ".".join(parts), None, ()
            for length in range(len(parts), unknown.bad_index, -1):
                entry = self.verl_keys.get(".".join(parts[:length]))
                if entry is not None:
                    return ".".join(parts[:length]), entry, parts[length:]
            return None

    def take_verl_key(self, parts: tuple[str, ...], value: Any, source: str | None = None) -> bool:
        """Take off a key verl writes that ember has no field for (see the module docstring); False for any other."""
        found = self.verl_key(parts)
        if found is None:
            return False
        key, entry, rest = found
        if entry is None:
            return True
        for part in reversed(rest):
            value = {part: value}
        self.verl_notes.pop(key, None)
        self.verl_refusals.pop(key, None)
        departures = entry.departures(value)
        if departures is not None:
            where = f" (in {source})" if source else ""
            text = f"{key}={departures!r}{where}: {entry.reason}"
            (self.verl_refusals if entry.refuse else self.verl_notes)[key] = text
        return True

    def _names_only_other_keys(self, parts: tuple[str, ...]) -> bool:
        """`parts` is no key of the schema but the head of aliases or verl keys (a section verl has and ember
        spells otherwise): its entries are assigned one by one."""
        try:
            locate(self.schema, parts)
            return False
        except UnknownKey:
            head = ".".join(parts) + "."
            return any(key.startswith(head) for key in (*self.aliases, *self.verl_keys))

    def locate(self, parts: tuple[str, ...], source: str | None = None) -> KeyLocation:
        """What `parts` names in the schema; an unknown key raises ConfigError with suggestions."""
        try:
            return locate(self.schema, parts)
        except UnknownKey as unknown:
            raise ConfigError(unknown_key_message(self.schema, unknown.parts, unknown.bad_index, source)) from None

    def merge(self, data: Any, source: str, prefix: tuple[str, ...] = ()) -> None:
        """Merge a YAML mapping into the tree at `prefix`; `source` names it in error messages."""
        if not isinstance(data, dict):
            where = ".".join(prefix) or "the top level"
            raise ConfigError(f"{where} in {source} must be a mapping of keys, got {data!r}")
        for key, value in data.items():
            self.assign(prefix + (str(key),), value, source)

    def assign(self, parts: tuple[str, ...], value: Any, source: str | None = None) -> None:
        """Set the key `parts` to `value`; a mapping given for a section or free-form mapping is merged into it."""
        parts = rewrite_alias(self.aliases, parts)
        if self.take_verl_key(parts, value, source):
            return
        if isinstance(value, dict) and self._names_only_other_keys(parts):  # verl's `engine:` of sft_trainer_engine
            for key, item in value.items():
                self.assign(parts + (str(key),), item, source)
            return
        location = self.locate(parts, source)
        nested = section_class(location.annotation) if location.free_form_depth is None else None
        if nested is not None and isinstance(value, dict):
            current = self._get(parts)
            self._container(parts, create_missing=True)[parts[-1]] = current if isinstance(current, dict) else defaults_tree(nested)
            for key, item in value.items():
                self.assign(parts + (str(key),), item, source)
            return
        if nested is not None and is_interpolation(value):  # the section another one points to, resolved at load
            self._container(parts, create_missing=True)[parts[-1]] = value
            return
        if nested is not None and (value is not None or type(None) not in union_members(location.annotation)):
            raise ConfigError(f"{'.'.join(parts)} is a section; set its keys ({'.'.join(parts)}.KEY=value), not {value!r}")
        container = self._container(parts, create_missing=True)
        current = container.get(parts[-1])
        if location.free_form_depth is not None and isinstance(value, dict) and isinstance(current, dict):
            _deep_merge(current, value)
        else:
            container[parts[-1]] = copy.deepcopy(value)

    def remove(self, parts: tuple[str, ...]) -> None:
        """Delete a key of a free-form mapping, or reset a schema key (or an optional section) to its default.

        A section every run has cannot be removed: Hydra's `~section` deletes it, which no run
        survives, and resetting all of its keys would silently drop values set before and
        surface later as errors about values the user never wrote."""
        parts = rewrite_alias(self.aliases, parts)
        if self.verl_key(parts) is not None:  # nothing of ember's to reset
            return
        location = self.locate(parts)
        if (location.free_form_depth is None and section_class(location.annotation) is not None
                and type(None) not in union_members(location.annotation)):
            dotted = ".".join(parts)
            raise ConfigError(f"cannot remove {dotted}: every run needs this section; reset the keys you changed "
                              f"one by one (~{dotted}.KEY), or set them (see `--describe {dotted}`)")
        inside_free_form = location.free_form_depth is not None and location.free_form_depth < len(parts) - 1
        container = self._container(parts, create_missing=False)
        if inside_free_form:
            if container is None or parts[-1] not in container:
                raise ConfigError(f"cannot remove {'.'.join(parts)}: it is not set")
            del container[parts[-1]]
            return
        if container is None:  # inside an optional section that is unset: nothing to reset
            return
        container[parts[-1]] = self._default(parts)

    def _default(self, parts: tuple[str, ...]) -> Any:
        """The schema default of a key, taken from the section's class where an optional section is unset."""
        node: Any = self.defaults
        for depth, part in enumerate(parts):
            if node is None:
                node = defaults_tree(section_class(locate(self.schema, parts[:depth]).annotation))
            node = node[part]
        return copy.deepcopy(node)

    def _get(self, parts: tuple[str, ...]) -> Any:
        container = self._container(parts, create_missing=False)
        return None if container is None else container.get(parts[-1])

    def _container(self, parts: tuple[str, ...], create_missing: bool) -> dict[str, Any] | None:
        """The dict holding the last part of `parts`; unset optional sections and free-form levels are created on request."""
        node = self.values
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                if not create_missing:
                    return None
                nested = section_class(locate(self.schema, parts[: depth + 1]).annotation)
                child = defaults_tree(nested) if nested is not None else {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(f"cannot set {'.'.join(parts)}: {'.'.join(parts[: depth + 1])} is {child!r}, not a mapping")
            node = child
        return node


def _deep_merge(target: dict[str, Any], incoming: dict[str, Any]) -> None:
    for key, value in incoming.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
