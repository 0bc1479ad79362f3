"""tests/gpu/megatron_parallel_worker.py on a CPU: the same engine, batch and update under one parallel layout,
after megatron_on_cpu's stand-ins (gloo between the ranks). Arguments as that worker's."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from megatron_on_cpu import stand_in_cuda  # noqa: E402

stand_in_cuda()

from gpu.megatron_parallel_worker import main  # noqa: E402

if __name__ == "__main__":
    main()
