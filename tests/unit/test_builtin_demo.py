"""The built-in demo's first seconds: its module loads without torch, so `ember train` prints
its first lines before the libraries that take seconds to import."""

import subprocess
import sys


def test_the_demo_module_imports_neither_torch_nor_transformers():
    code = "import sys, ember.trainer.builtin; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
