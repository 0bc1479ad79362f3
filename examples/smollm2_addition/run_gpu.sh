#!/usr/bin/env bash
# On the GPU host: rejoin the GGUF pieces, prepare, train, copy the curve and metrics to $1.
# RUN_DIR (default /tmp/smollm2_run) is the run's folder: give each variant its own, or the
# second run resumes from the first one's checkpoint.
set -euo pipefail
out=${1:?output folder}; shift
export EMBER_DATA=/tmp/smollm2_addition
run=${RUN_DIR:-/tmp/smollm2_run}
mkdir -p "$out"
cat /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
python3 examples/smollm2_addition/prepare.py /tmp/SmolLM2-135M-Instruct.Q4_1.gguf "$EMBER_DATA"
# Extra arguments go to `ember train` (e.g. --config-name config_aqn for the AQN variant,
# --config-name config_lora for LoRA; the last --config-name given wins).
python3 -m ember train --config-path examples/smollm2_addition --config-name config \
  trainer.default_local_dir="$run" "$@" 2>&1 | grep -v Warning
cp "$run"/metrics.jsonl "$run"/curves.png "$out"/
