"""ember's Triton kernels without a GPU: each runs under Triton's interpreter against the PyTorch path it replaces
(`interpreted_kernels.py`, in a process of its own), and every kernel compiles for an H100 (sm_90: Triton's passes,
then ptxas to a cubin) in each variant the engine and the fused log-prob path launch, as on the GPU machines.

The GPU tests (`tests/gpu`) run the kernels for real, at full sizes and in bf16; these keep a kernel that no longer
compiles, or that computes something else, from reaching a GPU at all. They need Triton (the `kernels` extra pins
the version the GPU machines' PyTorch ships) and skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from interpreted_kernels import CHECKS, fused_log_probs_and_grads  # noqa: E402

KERNEL_MODULES = ("ember.inference.kernels.sample", "ember.inference.kernels.nucleus",
                  "ember.inference.kernels.norm_act", "ember.inference.kernels.paged_decode", "ember.inference.kernels.rope_cache",
                  "ember.engines.log_prob_kernels")


def fresh_copies(monkeypatch, adapt) -> SimpleNamespace:
    """A new copy of each kernel module, `adapt`ed and put where ember's lazy imports find it; the modules ember
    imported are left as they were."""
    copies = {}
    for name in KERNEL_MODULES:
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        adapt(module)
        package, short = name.rsplit(".", 1)
        monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(importlib.import_module(package), short, module, raising=False)
        copies[short] = module
    return SimpleNamespace(**copies)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    """Each check of `interpreted_kernels.py`: "ok" or its traceback, from one process under the interpreter."""
    environment = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("interpreted_kernels.py"))], env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_kernel_under_the_interpreter_equals_its_pytorch_path(interpreted_results, check):
    assert interpreted_results[check] == "ok", interpreted_results[check]


class Hopper:
    """The driver Triton asks for its target: an H100's (sm_90), with no device behind it."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class CompileOnly:
    """Stands for a kernel: a launch `kernel[grid](...)` compiles it for the launch's arguments and runs nothing."""

    def __init__(self, name: str, kernel: JITFunction, compiled: list):
        self.name, self.kernel, self.compiled = name, kernel, compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append((self.name, self.kernel.warmup(*args, grid=grid, **kwargs)))
        return launch


@pytest.fixture
def compiled_for_h100(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "_active", Hopper())
    compiled: list = []
    kernels: list[str] = []

    def adapt(module):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                setattr(module, name, CompileOnly(name, value, compiled))
                kernels.append(name)

    return fresh_copies(monkeypatch, adapt), compiled, kernels


def test_every_kernel_compiles_for_an_h100_in_each_variant_the_engine_launches(compiled_for_h100):
    """Each kernel of the engine and the fused log-prob path, through its wrapper, with the dtypes and switches
    production launches it with: Triton's passes for sm_90, and ptxas to a cubin."""
    copies, compiled, kernels = compiled_for_h100
    bf16 = torch.bfloat16
    logits = torch.randn(4, 9001, dtype=bf16)
    seeds, positions = torch.randint(0, 1 << 31, (4,)), torch.arange(4)
    copies.sample.fused_sample(logits, logits, seeds, positions, 1 / 0.7, 0.7)  # untruncated draw
    copies.sample.fused_sample(logits.float(), logits, seeds, positions, 1.0, 1.0)  # truncated scores
    copies.sample.fused_sample(logits, logits, None, None, 1.0, 1.0)  # greedy
    copies.sample.combine_partials(copies.sample.sample_partials(logits, logits, seeds, positions, 1.0, 1.0, 4500))
    copies.nucleus.nucleus_threshold(logits.float(), 0.9)  # top-p without top-k

    states, weight = torch.randn(4, 576, dtype=bf16), torch.randn(576, dtype=bf16)
    copies.norm_act.rms_norm(states, weight, 1e-5)
    copies.norm_act.rms_norm(states, weight, 1e-5, residual=states.clone())
    copies.norm_act.rms_norm(states.float(), weight, 1e-5, residual=states.clone())  # a TP block's fp32 sum
    gate_up = torch.randn(4, 2 * 4864, dtype=bf16)
    copies.norm_act.silu_and_mul(*gate_up.chunk(2, dim=-1))

    for dtype in (bf16, torch.float32):
        cache = torch.randn(16, 16, 2, 64, dtype=dtype)
        queries, tables, context = torch.randn(3, 14, 64, dtype=dtype), torch.zeros(3, 4, dtype=torch.long), torch.ones(3, dtype=torch.long)
        for window in (None, 24):
            copies.paged_decode.paged_decode_attention(queries, cache, cache, tables, context, 0.125, window)
        fused = torch.randn(5, 18 * 64, dtype=dtype)
        queries, keys, values = (part.unflatten(-1, (-1, 64)) for part in fused.split([14 * 64, 2 * 64, 2 * 64], -1))
        copies.rope_cache.rope_and_cache(queries, keys, values, torch.randn(512, 64), torch.randn(512, 64),
                                         torch.arange(5), cache, cache, torch.arange(5))

    for entropy_grad in (False, True):
        fused_log_probs_and_grads(torch.randn(8, 32, dtype=bf16), torch.randn(5000, 32, dtype=bf16),
                                  torch.randint(0, 5000, (8,)), True, entropy_grad)

    assert sorted({name for name, _ in compiled}) == sorted(kernels), "a kernel was never launched here: add it"
    for name, kernel in compiled:
        assert kernel.metadata.target.arch == 90 and len(kernel.asm["cubin"]) > 1000, name
    assert len(compiled) >= 20
