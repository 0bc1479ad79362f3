"""FSDP2 sharding and offloading settings of one role (actor, reference, critic, reward model).

verl's `fsdp` and `fsdp2` strategies both map onto ember's FSDP2 engine, so one section
serves both; the field names are verl's.
"""

from dataclasses import dataclass
from typing import Any

from ember.config.schema.base import DType, field_


@dataclass
class FSDPConfig:
    """How a role's parameters are sharded over its GPUs and what is offloaded to CPU."""

    param_offload: bool = field_(False, "keep parameters in CPU memory while the role is idle")
    optimizer_offload: bool = field_(False, "keep optimizer state in CPU memory while the role is idle")
    offload_policy: bool = field_(
        False, "use FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step live on CPU")
    reshard_after_forward: bool = field_(True, "free gathered parameters after forward and gather them again for backward")
    fsdp_size: int = field_(-1, "GPUs in one sharding group; -1 = all GPUs of the role, smaller = hybrid sharding (HSDP)")
    forward_prefetch: bool = field_(False, "gather the next layer's parameters while the current layer computes")
    model_dtype: DType = field_("fp32", "dtype of the stored (master) parameters")
    full_determinism: bool = field_(
        False, "deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace, no cuDNN "
        "autotuning) for bitwise-repeatable runs; process-wide, slower where an operation needs its deterministic form")
    wrap_policy: dict[str, Any] = field_(
        {"min_num_params": 0}, "which modules become FSDP units (min_num_params, transformer_layer_cls_to_wrap); 0 = each decoder layer")
