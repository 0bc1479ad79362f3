"""Launching a test's two-rank worker: `torchrun --standalone --nproc_per_node 2` on gloo."""

from __future__ import annotations

import os
import subprocess
import sys

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def worker_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a launched worker: one CPU thread per rank (two ranks share a
    2-core machine), none of a surrounding launch's rank variables, and `extra` on top."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for name in LAUNCH_VARIABLES:
        environment.pop(name, None)
    return environment


def run_two_ranks(*args: str, timeout: float, environment: dict[str, str] | None = None) -> None:
    """`torchrun --standalone --nproc_per_node 2 ARGS`, raising CalledProcessError if it fails twice.

    A failed launch is started once more, from scratch: on a 2-core machine about one launch in
    40 loses a rank to a C++ abort ("terminate called without an active exception") while the
    process group starts, before the worker's own code runs (seen in CI, reproduced in a loop
    of 40). A fault of the code under test fails the second launch too. (torchrun's own
    `--max-restarts` hung here: its restarted pair never met.)
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    environment = environment or worker_environment()
    try:
        subprocess.run(command, check=True, env=environment, timeout=timeout)
    except subprocess.CalledProcessError:
        print("two-rank launch failed; starting it once more", file=sys.stderr, flush=True)
        subprocess.run(command, check=True, env=environment, timeout=timeout)
