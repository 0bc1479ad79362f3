"""What `ember train` imports before its set-up begins: the trainer's modules, without the engines' stack.

Imports are most of a run's start-up (issue 32; BENCHMARKS.md, "Launch to first step": `import torch`
alone took 5.3 s on an H100 host). transformers' model classes bring torch's compiler stack (dynamo,
sympy), DTensor and distributed checkpointing with them; a rank imports them when it builds its engines
(`rank_setup.build_engine`: in a one-process run, during its `roles` start-up phase), so the driver of a run
whose ranks are Ray workers never pays for them, and packages that only some runs use (plots, trackers, Ray,
Megatron, LoRA, the math reward) are imported when used. One module-level import on the trainer's path would bring any of them back into every run; these
tests fail naming what came back (`python -X importtime -c "import ember.trainer.rl"` shows who imported it).
"""

import json
import subprocess
import sys

import pytest

# ember's own modules that bring the stack (what transformers itself imports is not ember's to decide: its
# internals are left out, so a transformers release cannot fail this test)
ENGINE_STACK = ("ember.engines.fsdp", "ember.engines.megatron", "ember.models.loading", "ember.inference.engine",
                "torch.distributed.fsdp")
WHEN_USED = ("matplotlib", "tensorboard", "ray", "megatron", "peft", "wandb", "math_verify")


def loaded_after_import(module: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter holds after `import module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(set({watched!r}) & set(sys.modules))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout)


@pytest.mark.parametrize("module", ["ember.trainer.rl", "ember.nla.rl"])
def test_the_trainers_modules_leave_the_engines_and_optional_packages_unloaded(module):
    assert loaded_after_import(module, ENGINE_STACK + WHEN_USED) == []


def test_the_command_line_loads_neither_torch_nor_transformers():
    """`ember --help`, `--print-config`, `--describe` and a config error need neither."""
    assert loaded_after_import("ember.cli", ("torch", "transformers")) == []
