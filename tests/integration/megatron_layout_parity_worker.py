"""tests/gpu/megatron_parallel_worker.py on a CPU: the same engine, batch and update under one parallel layout,
after megatron_on_cpu's stand-ins (gloo between the ranks). Arguments as that worker's, and `--packed`: the engine
runs packed rows (`use_remove_padding`)."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from megatron_on_cpu import stand_in_cuda  # noqa: E402

stand_in_cuda()

from functools import partial  # noqa: E402

import gpu.megatron_parallel_worker as worker  # noqa: E402

if __name__ == "__main__":
    if "--packed" in sys.argv:  # the GPU worker has no such flag: its engine options get the switch
        sys.argv.remove("--packed")
        worker.MegatronOptions = partial(worker.MegatronOptions, use_remove_padding=True)
    worker.main()
