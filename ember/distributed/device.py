"""The one place that knows device names and collective backends.

Everything else in ember asks this module which device to put tensors on and which
torch.distributed backend to use, so that CUDA (NCCL), Ascend NPU (HCCL) and plain CPU
(gloo) runs share all other code. Nothing outside this file says "cuda" or "nccl".

Processes started by `torchrun` (or Ray workers given the same variables: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) join that group; a process started
without them is a world of one rank, which still gets a process group so that the same
FSDP2 code path runs everywhere.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

_BACKEND_OF_DEVICE = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo"}
_requested_device = "auto"


def request_device(name: str) -> None:
    """Use device type `name` (trainer.device): "auto" = the machine's accelerator, else the CPU;
    "cpu" even where an accelerator exists; an accelerator type only where this machine has it."""
    global _requested_device
    machine = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    if name not in ("auto", "cpu", machine):
        choices = "auto (or cpu)" if machine == "cpu" else f"auto (or {machine}, or cpu)"
        raise ValueError(f"trainer.device={name}, but this machine's device is {machine}: set trainer.device={choices}")
    _requested_device = name


def device_type() -> str:
    """The device type this process computes on: the machine's accelerator ("cuda", "npu", ...),
    or "cpu" without one or when trainer.device=cpu asked for it (`request_device`)."""
    if _requested_device != "cpu" and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def backend() -> str:
    """The torch.distributed backend for this machine's device type."""
    kind = device_type()
    if kind not in _BACKEND_OF_DEVICE:
        raise RuntimeError(f"no collective backend known for device type {kind!r}; "
                           f"ember supports {sorted(_BACKEND_OF_DEVICE)}")
    return _BACKEND_OF_DEVICE[kind]


def local_rank() -> int:
    """This process's index among the processes of its node (LOCAL_RANK, 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def current_device() -> torch.device:
    """The device this process computes on: its local accelerator, or the CPU."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, local_rank())


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the process group described by torchrun's variables, or make a one-rank group.

    Idempotent: a second call (another engine in the same process) does nothing. Also binds
    this process to its local accelerator. `timeout_s`: how long a collective may wait for the
    other ranks before failing (torch's default, 10 minutes, when None).
    """
    if dist.is_initialized():
        return
    device = current_device()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    bound_device = None if device.type == "cpu" else device  # lets collectives know their device up front
    options = dict(device_id=bound_device, **({"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend(), init_method="env://", **options)
    else:
        dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1, **options)


def separate_group(store: dist.Store, group_rank: int, group_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group beside this process's default one, over this device's backend (NCCL, gloo on the CPU):
    its members may belong to different default groups (the trainer's pool and the rollout's)."""
    timeout = timedelta(seconds=timeout_s)
    name = backend()
    if name == "gloo":
        return dist.ProcessGroupGloo(store, group_rank, group_size, timeout)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, group_rank, group_size, options)
    raise RuntimeError(f"a process group apart from the default one is built for gloo and nccl only, not {name}")


def shutdown_distributed() -> None:
    """Leave the process group together: a barrier, then its destruction. Tearing a group down
    while another rank still uses it, or leaving it to interpreter exit, can abort the process."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_distributed() -> bool:
    """Whether a torch.distributed process group exists (possibly of one rank)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes in the group (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def synchronize() -> None:
    """Wait for the device's queued work; no-op on CPU."""
    if device_type() != "cpu":
        torch.accelerator.synchronize()


def empty_cache() -> None:
    """Return cached device memory to the driver (after offloading); no-op on CPU."""
    if device_type() != "cpu":
        torch.accelerator.empty_cache()


def peak_memory_bytes() -> int:
    """The most memory this process has held: allocated device memory on an accelerator, the
    resident set size on the CPU."""
    if device_type() == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return torch.accelerator.max_memory_allocated()
