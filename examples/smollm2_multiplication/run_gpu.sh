#!/usr/bin/env bash
# On the GPU host: bash examples/smollm2_multiplication/run_gpu.sh OUT [ember train arguments...]; see ../run_smollm2.sh.
exec bash "$(dirname "$0")/../run_smollm2.sh" smollm2_multiplication "$@"
