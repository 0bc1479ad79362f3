"""megatron-core's process groups for one run: one layout, set up once per process.

`initialize_model_parallel` builds every group (tensor, pipeline, context, expert, data
parallel) from the world of the current torch.distributed group. Several Megatron roles in
one process (actor and reference, colocated) must agree on the layout: a second, different
layout is refused by name rather than silently reusing the first.
"""

from __future__ import annotations

import torch

from ember.distributed.device import device_type, init_distributed, world_size
from ember.errors import UserError

_layout: dict | None = None
_world_group = None  # the torch.distributed group the layout was built in


def initialize_layout(layout: dict[str, int | None], seed: int) -> None:
    """Set megatron-core's parallel state for `layout` (MegatronOptions.layout) and seed its
    model-parallel random-number tracker; a second call with the same layout does nothing."""
    global _layout, _world_group
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    init_distributed()
    if _layout is not None and dist.group.WORLD is not _world_group:
        # The process group was destroyed and made again (a library caller's second run in one
        # process): the groups megatron-core holds belong to the old one.
        mpu.destroy_model_parallel()
        _layout = None
    if _layout is not None:
        if layout != _layout:
            raise UserError(f"two Megatron roles in one process ask for different parallel layouts ({_layout} and "
                            f"{layout}); give actor, reference and critic the same megatron sizes, or put them in "
                            "separate resource pools")
        return
    _check_divides(layout)
    mpu.initialize_model_parallel(**layout)
    if device_type() == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    _layout, _world_group = dict(layout), dist.group.WORLD


def _check_divides(layout: dict[str, int | None]) -> None:
    world = world_size()
    tp, pp, cp = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                  layout["context_parallel_size"])
    if world % (tp * pp * cp):
        raise UserError(f"megatron: tensor × pipeline × context parallel size = {tp} × {pp} × {cp} = {tp * pp * cp} "
                        f"does not divide the {world} ranks of this role; choose sizes whose product divides {world}")
    if layout["virtual_pipeline_model_parallel_size"] and pp == 1:
        raise UserError("megatron.virtual_pipeline_model_parallel_size is set but pipeline_model_parallel_size is 1: "
                        "virtual stages interleave a pipeline; set pipeline_model_parallel_size > 1 or "
                        "virtual_pipeline_model_parallel_size: null")


def data_parallel_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group()


def data_parallel_size_and_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()


def is_last_pipeline_stage() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage()
