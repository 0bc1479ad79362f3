"""`--describe [PREFIX]`: every configuration key under PREFIX with its default and description."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ember.config.errors import ConfigError
from ember.config.introspect import field_types, schema_paths, section_class
from ember.config.schema.base import DESCRIPTION_KEY


def _entries(defaults: object, prefix: str) -> Iterator[str]:
    """`path = default  # description` for every field of `defaults`, sections as `path:  # description`."""
    cls = type(defaults)
    for field in dataclasses.fields(cls):
        path = prefix + field.name
        description = field.metadata[DESCRIPTION_KEY]
        nested = section_class(field_types(cls)[field.name])
        if nested is None:
            yield f"{path} = {getattr(defaults, field.name)!r}  # {description}"
            continue
        yield f"{path}:  # {description}"
        value = getattr(defaults, field.name)
        yield from _entries(value if dataclasses.is_dataclass(value) else nested(), path + ".")


def describe_keys(schema: type, prefix: str = "") -> str:
    """The `--describe` listing of the keys of `schema` at or under the dotted `prefix`."""
    if prefix and prefix not in schema_paths(schema):
        raise ConfigError(f"--describe {prefix}: no such key; the top-level sections are "
                          + ", ".join(field.name for field in dataclasses.fields(schema)))
    lines = [line for line in _entries(schema(), "")
             if not prefix or line.startswith((prefix + " ", prefix + ":", prefix + "."))]
    return "\n".join(lines) + "\n"
