"""YAML reading and writing with the scalar rules Hydra users expect.

PyYAML follows YAML 1.1, where `1e-6` is a string and `yes`/`on` are booleans. Config
files and command-line values here follow YAML 1.2 instead: `1e-6` is a float and only
true/false (any case) are booleans, so `lr=1e-6` and `name=yes` mean what they say.

A document is refused (`UnsafeYaml`) before it is built into Python objects when it nests
deeper than `MAX_DEPTH` or its aliases (`*name`) would add more than `MAX_ALIAS_EXPANSION`
values: a 1 kB "billion laughs" file would otherwise take minutes (OmegaConf, merging and
type checks all walk the expanded tree) and deep nesting ends in a RecursionError.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ember.config.errors import ConfigError

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")

MAX_DEPTH = 32
"""Deepest nesting of mappings and lists a config may have (ember's own are under 10 deep)."""
MAX_ALIAS_EXPANSION = 10_000
"""Most values that aliases may add to a document when each is expanded into a copy of its anchor."""


class UnsafeYaml(yaml.YAMLError):
    """A document nested too deeply, or whose aliases expand it beyond MAX_ALIAS_EXPANSION values."""


class ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and exponent floats without a dot (1e-6), refusing
    documents nested deeper than MAX_DEPTH or expanded by aliases beyond MAX_ALIAS_EXPANSION."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise UnsafeYaml(f"it nests mappings or lists more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A mapping, refusing a key written twice (PyYAML keeps the last silently; Hydra's loader refuses it)."""
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key_node.value in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is written twice (lines {lines[key_node.value]} and "
                        f"{line}); keep one", key_node.start_mark)
                lines[key_node.value] = line
        return super().construct_mapping(node, deep=deep)

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node


def _check_expansion(root: yaml.Node) -> None:
    """Raise UnsafeYaml when `root`, each alias expanded, nests beyond MAX_DEPTH or its aliases add
    more than MAX_ALIAS_EXPANSION values. Each distinct node is counted once (memoised), so the
    check takes time in the file's size, not the expansion's."""
    expanded: dict[int, int] = {}  # id(node) -> values in the node with its aliases expanded
    in_progress: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if id(node) in expanded:
            return expanded[id(node)]
        if id(node) in in_progress:
            raise UnsafeYaml("an alias refers to a mapping or list that contains it")
        if depth > MAX_DEPTH:
            raise UnsafeYaml(f"its aliases nest mappings or lists more than {MAX_DEPTH} levels deep")
        in_progress.add(id(node))
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
        expanded[id(node)] = 1 + sum(size(child, depth + 1) for child in children)
        in_progress.discard(id(node))
        return expanded[id(node)]

    added = size(root, 1) - len(expanded)
    if added > MAX_ALIAS_EXPANSION:
        raise UnsafeYaml(f"its aliases (*name) expand to {added:,} more values than the file holds, beyond the "
                         f"limit of {MAX_ALIAS_EXPANSION:,} (a YAML alias bomb?); write the repeated parts out")


ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))
ConfigYamlLoader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+.0123456789"))


def read_yaml_file(path: str) -> Any:
    """The contents of the YAML file at `path`; a syntax error, bytes that are not UTF-8, nesting
    or alias expansion past the limits, or a file that cannot be read name the file."""
    try:
        with open(path, encoding="utf-8") as stream:
            return yaml.load(stream, Loader=ConfigYamlLoader)
    except UnsafeYaml as error:
        raise ConfigError(f"{path} cannot be used as a config: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text (byte {error.object[error.start]:#x} at offset {error.start}); "
                          "save it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None


def parse_yaml_value(text: str) -> Any:
    """A command-line value read as YAML (`[a, b]`, `null`, `1e-6`, `'quoted'`); empty text is ''."""
    if text == "":
        return ""
    return yaml.load(text, Loader=ConfigYamlLoader)


def dump_yaml(data: Any) -> str:
    """Block-style YAML in the mapping's own key order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
