"""The tool config YAML (verl's format) → tool objects by name.

```yaml
tools:
  - class_name: ember.agent.tools.gsm8k.Gsm8kTool   # or verl's name for it, see VERL_TOOL_CLASSES
    config: {}                                       # passed to the class as `config`
    tool_schema:                                     # OpenAI function schema; its name is what the model calls
      type: function
      function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}
```

A class is imported by its dotted path (a user's own tool: any importable module, subclassing
`ember.agent.tools.BaseTool` or only having its methods). verl's own tool classes that ember ships under
another path are mapped to them, so a verl tool config loads unchanged; other `verl.` classes are refused
by name. Every mistake is a `ConfigError` naming the file, the entry and the key to change.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ember.config.errors import ConfigError
from ember.config.yaml_io import read_yaml_file

VERL_TOOL_CLASSES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "ember.agent.tools.gsm8k.Gsm8kTool",
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": "ember.agent.tools.gsm8k.Gsm8kTool",
}
"""verl's tool classes (both of its module paths over time) → ember's implementation of the same tool."""

_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"


def load_tools(path: str) -> dict:
    """The tools of the YAML at `path`, by the function name the model calls them with."""
    if not Path(path).is_file():
        raise ConfigError(f"{_KEY}={path}: no such file; give the tool config YAML (tools: [{{class_name, config, "
                          "tool_schema}}])")
    document = read_yaml_file(path)
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} ({_KEY}): expected a non-empty list under 'tools:'")
    tools = {}
    for index, entry in enumerate(entries):
        where = f"{path}, tools[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(f"{where}: each tool needs class_name (a dotted class path)")
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConfigError(f"{where}: tool_schema needs function.name (the name the model calls the tool by)")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: config must be a mapping (or absent)")
        tool = _tool_class(entry["class_name"], where)(config, schema)
        if function["name"] in tools:
            raise ConfigError(f"{where}: a second tool named {function['name']!r}; give each tool its own name")
        tools[function["name"]] = tool
    return tools


def _tool_class(class_name: str, where: str) -> type:
    path = VERL_TOOL_CLASSES.get(class_name, class_name)
    if path.startswith("verl."):
        shipped = ", ".join(sorted(set(VERL_TOOL_CLASSES.values())) + ["ember.agent.tools.python_code.PythonCodeTool"])
        raise ConfigError(f"{where}: class_name={class_name} is verl's and ember has no version of it; use one of "
                          f"{shipped}, or your own class")
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{where}: class_name={class_name} cannot be imported ({error})") from None
    missing = [method for method in ("create", "execute", "calc_reward", "release") if not hasattr(cls, method)]
    if missing:
        raise ConfigError(f"{where}: {class_name} lacks {', '.join(missing)} (verl's tool interface: create, execute, "
                          "calc_reward, release; subclass ember.agent.tools.BaseTool)")
    return cls
