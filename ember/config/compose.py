"""Composing a run config from `--config-path DIR --config-name NAME` and the file's Hydra `defaults:` list.

A defaults entry is `_self_` (this file's own keys), the name of one of ember's built-in
bases (`ppo_trainer`, `ppo_megatron_trainer`, `sft_trainer`: the schema defaults;
`nla_grpo_full` under `ember nla train`) unless a file of that name is there, another YAML
file (looked up next to the including file, then in the config directory; a leading `/`, as
in `- /nla_grpo_full`, looks in the config directory only), or
`{group: name}` / `{group@package: name}` (the file `group/name.yaml`, placed under
`package`, which defaults to the group). Without `_self_` the file's keys come last, as in
Hydra. A top-level `hydra:` section configures Hydra itself and is ignored here. A
`--config-name` that names a built-in base with no such file in the folder (verl scripts
pass `--config-name ppo_megatron_trainer`) loads that base.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ember.config.errors import ConfigError
from ember.config.yaml_io import read_yaml_file


@dataclass(frozen=True)
class Layer:
    """One mapping to merge, in order, with where it came from."""

    source: str  # file path or "built-in base NAME", for error messages
    data: dict[str, Any]


def compose_layers(config_dir: str | None, config_name: str, builtin_bases: dict[str, dict[str, Any]]) -> list[Layer]:
    """The layers of `config_name` (a path below `config_dir`, `.yaml` optional) in merge order."""
    root = config_dir if config_dir is not None else os.getcwd()
    if _is_builtin([root], config_name, builtin_bases):  # verl scripts name verl's own files
        return [_builtin_layer(config_name, builtin_bases)]
    return _layers_of(_find([root], config_name), root, builtin_bases, ())


def _builtin_layer(name: str, builtin_bases: dict[str, dict[str, Any]]) -> Layer:
    base = name.removesuffix(".yaml")
    return Layer(f"built-in base {base}", builtin_bases[base])


def _candidates(search_dirs: list[str], name: str) -> list[str]:
    filename = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    return [os.path.join(directory, filename) for directory in search_dirs]


def _find(search_dirs: list[str], name: str) -> str:
    candidates = _candidates(search_dirs, name)
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise ConfigError(f"config {name!r} not found (looked for {' and '.join(candidates)}); check --config-path and --config-name")


def _is_builtin(search_dirs: list[str], name: str, builtin_bases: dict[str, dict[str, Any]]) -> bool:
    """Whether `name` means a built-in base: it is one, and no file of that name shadows it."""
    in_folder = any(os.path.isfile(candidate) for candidate in _candidates(search_dirs, name))
    return name.removesuffix(".yaml") in builtin_bases and not in_folder


def _layers_of(path: str, root: str, builtin_bases: dict[str, dict[str, Any]], including: tuple[str, ...]) -> list[Layer]:
    if path in including:
        raise ConfigError(f"{path} includes itself through its defaults list: {' -> '.join(including + (path,))}")
    data = read_yaml_file(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of configuration keys, not {type(data).__name__}")
    data = dict(data)
    defaults = data.pop("defaults", None) or []
    data.pop("hydra", None)
    if not isinstance(defaults, list):
        raise ConfigError(f"defaults in {path} must be a list, got {defaults!r}")
    if "_self_" not in defaults:
        defaults = defaults + ["_self_"]
    search_dirs = [os.path.dirname(path), root]
    layers: list[Layer] = []
    for entry in defaults:
        if entry == "_self_":
            layers.append(Layer(path, data))
        elif isinstance(entry, str):
            name, dirs = (entry[1:], [root]) if entry.startswith("/") else (entry, search_dirs)
            if _is_builtin(dirs, name, builtin_bases):
                layers.append(_builtin_layer(name, builtin_bases))
            else:
                layers.extend(_layers_of(_find(dirs, name), root, builtin_bases, including + (path,)))
        elif isinstance(entry, dict) and len(entry) == 1:
            layers.extend(_group_layers(entry, path, root, builtin_bases, including + (path,)))
        else:
            raise ConfigError(f"defaults entry {entry!r} in {path} is not understood; "
                              "use _self_, a config name, or {group: name}")
    return layers


def _group_layers(entry: dict[str, Any], path: str, root: str, builtin_bases: dict[str, dict[str, Any]],
                  including: tuple[str, ...]) -> list[Layer]:
    ((group_spec, name),) = entry.items()
    group, _, package = str(group_spec).partition("@")
    if not isinstance(name, str):
        raise ConfigError(f"defaults entry {entry!r} in {path} must name one config of group {group}")
    included = _find([os.path.join(os.path.dirname(path), group), os.path.join(root, group)], name)
    package_parts = [] if package == "_global_" else (package or group.replace("/", ".")).split(".")
    layers = []
    for layer in _layers_of(included, root, builtin_bases, including):
        data = layer.data
        for part in reversed(package_parts):
            data = {part: data}
        layers.append(Layer(layer.source, data))
    return layers
