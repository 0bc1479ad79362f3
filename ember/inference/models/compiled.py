"""`compiled_on_cuda`: a small tensor function run as itself on CPU tensors and as one torch.compile'd kernel
on CUDA tensors.

A decode step does little arithmetic per kernel, so elementwise chains (RoPE's fallback, FP8's
per-token activation quantisation) are worth one fused kernel on CUDA; compiled with dynamic shapes,
one compilation serves every batch size and prefill. Other devices run the plain function (the reference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def compiled_on_cuda(function: Callable) -> Callable:
    """`function` itself on CPU tensors, its torch.compile'd version (built on first use) on CUDA tensors."""
    compiled = None

    @functools.wraps(function)
    def run(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return function(*args)
        if compiled is None:
            compiled = torch.compile(function, dynamic=True, fullgraph=True)
        return compiled(*args)

    return run
