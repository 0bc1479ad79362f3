"""`fsdp_config.full_determinism` (verl's key): the same inputs give bitwise the same run on one GPU.

What can differ between two runs of the same step on a GPU: kernels that accumulate with
atomics (scatter-adds, some attention backward passes, index_add in backward), cuBLAS's choice of
workspace and split-K per stream, and cuDNN's autotuner. `enable_full_determinism` asks PyTorch
for its deterministic kernels (warning, not failing, where an operation has none), pins cuBLAS's
workspace (`CUBLAS_WORKSPACE_CONFIG`, read when the first cuBLAS handle is made, so this runs
before the engine's first matmul), turns off cuDNN's autotuner, asks NCCL for a fixed reduction
order and flash-attention for its deterministic backward, and seeds Python, NumPy and torch.
It is a process-wide switch, as in PyTorch: every engine of the process runs deterministically.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

# cuBLAS is deterministic with either of its two documented workspace settings; ":4096:8" (8 workspaces of 4 MiB,
# ~24 MiB more device memory) keeps its faster kernels, ":16:8" "may limit overall performance" (PyTorch's
# reproducibility notes). The switch cost 34% of the 0.5B GRPO step with ":16:8" on an H100 (BENCHMARKS.md).
ENVIRONMENT = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_DETERMINISTIC": "1", "FLASH_ATTENTION_DETERMINISTIC": "1"}


def enable_full_determinism(seed: int) -> None:
    """Deterministic kernels for the rest of this process (see the module docstring)."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
