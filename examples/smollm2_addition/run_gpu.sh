#!/usr/bin/env bash
# On the GPU host: bash examples/smollm2_addition/run_gpu.sh OUT [ember train arguments...]
# (e.g. --config-name config_aqn for the AQN variant, --config-name config_lora for LoRA); see ../run_smollm2.sh.
exec bash "$(dirname "$0")/../run_smollm2.sh" smollm2_addition "$@"
