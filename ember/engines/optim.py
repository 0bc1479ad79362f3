"""AdamW and its learning-rate schedule (linear warmup, then constant or cosine decay).

The schedule is a pure function of the optimizer-step count, `lr_multiplier`, wrapped in a
LambdaLR so its state is two integers and resumes exactly. Steps here are OPTIMIZER steps
(one per `train_mini_batch`): a caller whose config counts training steps of the RL loop
multiplies by the updates per step when filling `total_training_steps` and `lr_warmup_steps`.
Field names follow verl's `optim` section.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

LR_SCHEDULER_TYPES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimOptions:
    """How the trained model's parameters are updated."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every parameter."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad: float = 1.0
    """Gradients are rescaled so their global L2 norm is at most this; <= 0 disables clipping."""
    lr_warmup_steps: int = -1
    """Optimizer steps of linear warmup from 0 to `lr`; negative: use `lr_warmup_steps_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of `total_training_steps`, used when `lr_warmup_steps` is negative."""
    lr_scheduler_type: str = "constant"
    """After warmup: "constant" keeps `lr`; "cosine" decays it towards `min_lr_ratio × lr`."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule, as a fraction of `lr`."""
    num_cycles: float = 0.5
    """Cosine periods over the decay phase; 0.5 is a single half-cosine from `lr` to the floor."""
    total_training_steps: int = 0
    """Optimizer steps of the whole run; needed by "cosine" and by a warmup ratio."""

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in LR_SCHEDULER_TYPES:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}: choose one of {LR_SCHEDULER_TYPES}")
        warmup_from_ratio = self.lr_warmup_steps < 0 and self.lr_warmup_steps_ratio > 0
        needs_total = self.lr_scheduler_type == "cosine" or warmup_from_ratio
        if needs_total and self.total_training_steps <= 0:
            raise ValueError("the cosine schedule and lr_warmup_steps_ratio need total_training_steps > 0; "
                             "set it (in optimizer steps) or use a constant schedule with lr_warmup_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: choose a fraction in [0, 1]")

    @property
    def warmup_steps(self) -> int:
        """Warmup length in optimizer steps, resolved from the steps or the ratio."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * self.total_training_steps)


def lr_multiplier(step: int, options: OptimOptions) -> float:
    """Fraction of the peak learning rate to use at optimizer step `step` (0-based)."""
    warmup = options.warmup_steps
    if step < warmup:
        return step / warmup
    if options.lr_scheduler_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, options.total_training_steps - warmup))
    cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * options.num_cycles * progress))
    return options.min_lr_ratio + (1.0 - options.min_lr_ratio) * cosine


def build_optimizer(parameters: Iterable[torch.nn.Parameter], options: OptimOptions) -> torch.optim.AdamW:
    """AdamW over `parameters` with the options' hyper-parameters, PyTorch's fused kernel wherever the
    parameters live: on an accelerator one launch for all of them; in CPU memory (a CPU run, FSDP2's
    offload policy) a vectorised multi-threaded loop, 13x the default per-tensor step on 2 cores
    for a 0.5B model (0.19 vs 2.55 s)."""
    return torch.optim.AdamW(parameters, lr=options.lr, betas=options.betas, eps=options.eps,
                             weight_decay=options.weight_decay, fused=True)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, options: OptimOptions) -> LambdaLR:
    """The schedule of `lr_multiplier`, stepped once per optimizer step."""

    def multiplier(step: int) -> float:
        return lr_multiplier(step, options)

    return LambdaLR(optimizer, multiplier)
