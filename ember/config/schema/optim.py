"""Optimizer and learning-rate schedule of a trained role (AdamW; linear warmup, then constant or cosine).

`total_training_steps` is -1 in a config file: the schedule always runs over the run's own
step count (`trainer.total_training_steps`, else epochs × steps per epoch), as verl overwrites
the key with it; a different value set by the user is reported, not used. `warmup_style` is
verl's older name for `lr_scheduler_type`; the loader copies it over (see
`ember/config/normalize.py`).
"""

from dataclasses import dataclass
from typing import Literal

from ember.config.schema.base import field_

LRSchedulerType = Literal["constant", "cosine"]


@dataclass
class OptimConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    lr: float = field_(1e-6, "peak learning rate")
    lr_warmup_steps: int = field_(-1, "steps of linear warmup from 0 to lr; negative = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = field_(
        0.0, "warmup length as a fraction of total_training_steps, used when lr_warmup_steps < 0")
    min_lr_ratio: float = field_(0.0, "floor of the cosine schedule as a fraction of lr")
    warmup_style: LRSchedulerType | None = field_(None, "deprecated name of lr_scheduler_type; null = not given")
    lr_scheduler_type: LRSchedulerType = field_(
        "constant", "after warmup: constant keeps lr, cosine decays it to min_lr_ratio × lr")
    num_cycles: float = field_(0.5, "cosine periods over the decay phase; 0.5 = one half-cosine down to the floor")
    total_training_steps: int = field_(
        -1, "verl: steps of the whole run, filled in by the trainer; another value set here is logged and "
            "ignored (no effect: ember computes it from the run)")
    weight_decay: float = field_(0.01, "AdamW decoupled weight decay")
    betas: list[float] = field_([0.9, 0.999], "AdamW moment decay rates [beta1, beta2]")
