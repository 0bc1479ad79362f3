"""Composing a run config from `--config-path DIR --config-name NAME` and the file's Hydra `defaults:` list.

A defaults entry is `_self_` (this file's own keys), the name of one of ember's built-in
bases (`ppo_trainer`, `ppo_megatron_trainer`, `sft_trainer`: the schema defaults;
`nla_grpo_full` under `ember nla train`) unless a file of that name is there, another YAML
file (looked up next to the including file, then in the config directory; a leading `/`, as
in `- /nla_grpo_full`, looks in the config directory only), or
`{group: name}` / `{group@package: name}` (the file `group/name.yaml`, placed under
`package`, which defaults to the group; `../optim@optim` in `actor/dp_actor.yaml` is the
`optim` group placed under the actor). `override /group@package: name` replaces the option
a defaults list further down chose for that group and package (verl's run files write
`override /actor@actor_rollout_ref.actor: megatron_actor`), as `group=name` on the command
line does (`GroupChoice`); a choice that matches no entry is an error. Without `_self_` the
file's keys come last, as in Hydra. A top-level `hydra:` section configures Hydra itself and is ignored here. A
`--config-name` that names a built-in base with no such file in the folder (verl scripts
pass `--config-name ppo_megatron_trainer`) loads that base.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ember.config.errors import ConfigError
from ember.config.yaml_io import read_yaml_file


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layer:
    """One mapping to merge, in order, with where it came from."""

    source: str  # file path or "built-in base NAME", for error messages
    data: dict[str, Any]


@dataclass(frozen=True)
class GroupChoice:
    """A Hydra group choice from outside the defaults list that would make it: `override GROUP@PACKAGE: OPTION`
    in a run file's defaults, `GROUP=OPTION` on the command line (package None: any package of that group)."""

    group: str  # the group folder below the config directory, e.g. "actor"
    package: str | None  # where its keys go, e.g. "actor_rollout_ref.actor"; "" = the top level
    option: str
    origin: str  # for error messages


def compose_layers(config_dir: str | None, config_name: str, builtin_bases: dict[str, dict[str, Any]],
                   choices: tuple[GroupChoice, ...] = (), additions: tuple[GroupChoice, ...] = (),
                   implicit_base: str | None = None) -> list[Layer]:
    """The layers of `config_name` (a path below `config_dir`, `.yaml` optional) in merge order.

    `choices` replace the option of a group entry of the defaults lists (`GROUP=OPTION`); `additions` are
    groups the defaults lists lack, merged last (`+GROUP=OPTION`). A `config_name` file without a `defaults:`
    list extends `implicit_base` (the command's base, `nla_grpo_full` under `ember nla train`), with one log
    line naming the base taken."""
    root = config_dir if config_dir is not None else os.getcwd()
    if _is_builtin([root], config_name, builtin_bases):  # verl scripts name verl's own files
        layers = [_builtin_layer(config_name, builtin_bases)]
    else:
        composer = _Composer(root, builtin_bases, list(choices))
        layers = composer.layers_of(_find([root], config_name), (), (), implicit_base)
        unused = [choice for choice in composer.choices if choice not in composer.used]
        if unused:
            choice = unused[0]
            target = f"{choice.group}@{choice.package}" if choice.package is not None else choice.group
            raise ConfigError(f"{choice.origin} chooses {choice.option} for group {target}, but no defaults list "
                              f"holds an entry of that group; add it with +{target}={choice.option}")
    for addition in additions:
        layers.extend(_Composer(root, builtin_bases, []).group_layers(
            "/" + addition.group, addition.package, addition.option, (), root, ()))
    return layers


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


class _Composer:
    """Walks the defaults lists from the primary file down, applying the group choices made from above."""

    def __init__(self, root: str, builtin_bases: dict[str, dict[str, Any]], choices: list[GroupChoice]):
        self.root, self.builtin_bases = root, builtin_bases
        self.choices = choices  # outer choices first: they win over inner ones
        self.used: list[GroupChoice] = []

    def layers_of(self, path: str, package: tuple[str, ...], including: tuple[str, ...],
                  implicit_base: str | None = None) -> list[Layer]:
        """The layers of the file `path`, whose keys go under `package`, in merge order (keys relative to `package`);
        without a `defaults:` list it extends `implicit_base` when one is given."""
        if path in including:
            raise ConfigError(f"{path} includes itself through its defaults list: {' -> '.join(including + (path,))}")
        data = read_yaml_file(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of configuration keys, not {type(data).__name__}")
        data = dict(data)
        if "defaults" not in data and implicit_base is not None:
            data["defaults"] = ["/" + implicit_base, "_self_"]
            base = ("ember's built-in base" if _is_builtin([self.root], implicit_base, self.builtin_bases)
                    else _find([self.root], implicit_base))
            logger.warning("%s has no defaults list: it extends %s (%s), the command's base; write `defaults: "
                           "[_self_]` to start from the schema defaults instead", path, implicit_base, base)
        defaults = data.pop("defaults", None) or []
        data.pop("hydra", None)
        if not isinstance(defaults, list):
            raise ConfigError(f"defaults in {path} must be a list, got {defaults!r}")
        if "_self_" not in defaults:
            defaults = defaults + ["_self_"]
        entries = []
        for entry in defaults:
            spec = next(iter(entry)) if isinstance(entry, dict) and len(entry) == 1 else None
            if isinstance(spec, str) and spec.startswith("override "):
                group, _, entry_package = spec.removeprefix("override ").strip().partition("@")
                self.choices.append(GroupChoice(self._group_below_root(group, os.path.dirname(path)), ".".join(
                    _absolute_package(package, group, entry_package)), str(entry[spec]), f"override {spec.removeprefix('override ').strip()} "
                    f"in {path}"))
            else:
                entries.append(entry)
        search_dirs = [os.path.dirname(path), self.root]
        layers: list[Layer] = []
        for entry in entries:
            if entry == "_self_":
                layers.append(Layer(path, data))
            elif isinstance(entry, str):
                name, dirs = (entry[1:], [self.root]) if entry.startswith("/") else (entry, search_dirs)
                if _is_builtin(dirs, name, self.builtin_bases):
                    layers.append(_builtin_layer(name, self.builtin_bases))
                else:
                    layers.extend(self.layers_of(_find(dirs, name), package, including + (path,)))
            elif isinstance(entry, dict) and len(entry) == 1:
                ((group_spec, option),) = entry.items()
                if not isinstance(option, str):
                    raise ConfigError(f"defaults entry {entry!r} in {path} must name one config of its group")
                group, _, entry_package = str(group_spec).partition("@")
                layers.extend(self.group_layers(group, entry_package, option, package, os.path.dirname(path),
                                                including + (path,)))
            else:
                raise ConfigError(f"defaults entry {entry!r} in {path} is not understood; "
                                  "use _self_, a config name, {group: name} or override /group@package: name")
        return layers

    def group_layers(self, group: str, entry_package: str | None, option: str, package: tuple[str, ...],
                     including_dir: str, including: tuple[str, ...]) -> list[Layer]:
        """The layers of option `option` of `group` (written in a file of `including_dir`), placed under its package."""
        absolute = _absolute_package(package, group, entry_package or "")
        group_path = self._group_below_root(group, including_dir)
        for choice in self.choices:
            if choice.group == group_path and choice.package in (None, ".".join(absolute)):
                option = choice.option
                self.used.append(choice)
                break
        candidates = [os.path.join(self.root, group_path)] if group.startswith("/") else [
            os.path.join(including_dir, group), os.path.join(self.root, group)]
        included = _find(candidates, option)
        layers = []
        for layer in self.layers_of(included, absolute, including):
            data = layer.data
            for part in reversed(absolute[len(package):]):
                data = {part: data}
            layers.append(Layer(layer.source, data))
        return layers

    def _group_below_root(self, group: str, including_dir: str) -> str:
        """A group as a folder path below the config directory (`/actor`, and `../actor` in `ref/`, give `actor`)."""
        if group.startswith("/"):
            return os.path.normpath(group.lstrip("/"))
        return os.path.normpath(os.path.join(os.path.relpath(including_dir, self.root), group))


def _absolute_package(package: tuple[str, ...], group: str, entry_package: str) -> tuple[str, ...]:
    """Where an entry's keys go from the top level: its own package (default: the group's path) below `package`."""
    if entry_package == "_global_":
        return ()
    if entry_package:
        return package + tuple(entry_package.split("."))
    return package + tuple(part for part in group.strip("/").split("/") if part not in ("", ".", ".."))
