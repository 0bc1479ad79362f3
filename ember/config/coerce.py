"""Turning a resolved mapping into the typed schema dataclasses, checking every value's type.

Accepted conversions are the ones a YAML or command-line user expects: an integer where a
number is wanted, a whole float (2.0, 1e3) where an integer is wanted, a number where a
string is wanted, a single item where a list is wanted (`trainer.logger=console`), and
Python's `None` as null for a key that may be null (`...virtual_pipeline_model_parallel_size=None`).
Anything else is a ConfigError naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from ember.config.errors import ConfigError
from ember.config.introspect import field_types, union_members

HYDRA_MISSING = "???"  # Hydra's (and verl's files') value for "the user must give this"
_SCALAR_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


class _Mismatch(Exception):
    """A value does not fit an annotation; carries the description of what would."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def build(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """An instance of the dataclass `cls` from `data`, which must hold exactly its fields."""
    kwargs = {}
    for name, annotation in field_types(cls).items():
        key = f"{path}.{name}" if path else name
        if name not in data:
            raise ConfigError(f"{key} is missing")
        kwargs[name] = convert(annotation, data[name], key)
    extra = set(data) - set(kwargs)
    if extra:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(extra))} under {path or 'the top level'}")
    return cls(**kwargs)


def convert(annotation: Any, value: Any, key: str) -> Any:
    """`value` checked against (and converted to) `annotation`; raises ConfigError naming `key`."""
    if value == HYDRA_MISSING:
        raise ConfigError(f"{key} must be given: the config file leaves it as ??? (Hydra's mark for a value the user "
                          f"sets), e.g. {key}=VALUE")
    try:
        return _convert(annotation, value, key)
    except _Mismatch as mismatch:
        raise ConfigError(f"invalid value for {key}: {value!r} (expected {mismatch.expected})") from None


def expected_text(annotation: Any) -> str:
    """How an annotation reads in an error message: 'an integer or null', 'one of: a, b'."""
    if annotation is Any:
        return "any value"
    if dataclasses.is_dataclass(annotation):
        return "a mapping"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of: " + ", ".join(str(choice) for choice in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"a list of items that are each {expected_text(item)}"
    if origin is dict:
        return "a mapping"
    members = union_members(annotation)
    if len(members) > 1:
        return " or ".join(expected_text(member) for member in members)
    return _SCALAR_NAMES[annotation]


def _convert(annotation: Any, value: Any, key: str) -> Any:
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise _Mismatch(f"a mapping of the keys of {key}")
        return build(annotation, value, key)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        for choice in typing.get_args(annotation):
            if value == choice and type(value) is type(choice):
                return value
        raise _Mismatch(expected_text(annotation))
    if origin is list:
        return _convert_list(annotation, value, key)
    if origin is dict:
        return _convert_dict(annotation, value, key)
    members = union_members(annotation)
    if len(members) > 1:
        return _convert_union(members, value, key)
    return _convert_scalar(annotation, value)


def _convert_union(members: tuple[Any, ...], value: Any, key: str) -> Any:
    if value == "None" and type(None) in members:  # Python's spelling of null, as seed scripts pass it
        return None
    for member in members:
        try:
            return _convert(member, value, key)
        except _Mismatch:
            continue
    raise _Mismatch(" or ".join(expected_text(member) for member in members))


def _convert_list(annotation: Any, value: Any, key: str) -> list[Any]:
    (item,) = typing.get_args(annotation)
    if not isinstance(value, list):
        try:
            return [_convert(item, value, key)]
        except _Mismatch:
            raise _Mismatch(expected_text(annotation)) from None
    items = []
    for index, element in enumerate(value):
        try:
            items.append(_convert(item, element, f"{key}[{index}]"))
        except _Mismatch:
            raise _Mismatch(f"{expected_text(annotation)}; item {index} is {element!r}") from None
    return items


def _convert_dict(annotation: Any, value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Mismatch("a mapping")
    key_type, value_type = typing.get_args(annotation)
    converted = {}
    for name, element in value.items():
        if not isinstance(name, key_type):
            raise _Mismatch(f"a mapping whose keys are each {expected_text(key_type)}; {name!r} is not")
        converted[name] = convert(value_type, element, f"{key}.{name}")
    return converted


def _convert_scalar(annotation: type, value: Any) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif annotation is type(None):
        if value is None:
            return None
    else:
        raise TypeError(f"the config schema uses {annotation!r}, which ember/config/coerce.py does not handle")
    raise _Mismatch(_SCALAR_NAMES[annotation])
