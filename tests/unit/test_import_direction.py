"""Imports between ember's packages point one way: a lower package never imports the one above it,
not even inside a function (such an import only hides a loop)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ember

EMBER = Path(ember.__file__).parent

LOWER_NEVER_IMPORTS_UPPER = [
    ("inference", "ember.rollout"),  # the rollout package wraps the engine; the engine's request records are its own
    ("trainer", "ember.nla"),  # NLA's trainers build on the trainer's loops
    ("inference", "ember.agent"),  # the agent loop drives the engine
    ("rollout", "ember.agent"),  # the agent loop returns the rollout's records
]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (`from ember import nla` reads as ember.nla)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "ember" else [f"ember.{alias.name}" for alias in node.names]
            found += [(node.lineno, name) for name in names]
    return found


@pytest.mark.parametrize("package, upper", LOWER_NEVER_IMPORTS_UPPER)
def test_lower_package_never_imports_the_one_above(package, upper):
    offending = [f"{path.relative_to(EMBER.parent)}:{line} imports {module}"
                 for path in sorted((EMBER / package).rglob("*.py"))
                 for line, module in imported_modules(path)
                 if module == upper or module.startswith(upper + ".")]
    assert not offending, "\n".join(offending)


def test_importing_the_rollout_interface_leaves_the_engine_unloaded():
    """The request records come from `ember.inference` without its engine (models, kernels, transformers)."""
    code = ("import sys, ember.rollout; "
            "print(sorted(m for m in sys.modules if m in ('ember.inference.engine', 'transformers')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
