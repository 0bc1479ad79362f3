#!/usr/bin/env bash
# On the GPU host, from the repository's root: rejoin the GGUF pieces, prepare, train, copy the curve and
# metrics to $1. RUN_DIR (default /tmp/smollm2_mul_run) is the run's folder; extra arguments go to `ember train`.
set -euo pipefail
out=${1:?output folder}; shift
export EMBER_DATA=/tmp/smollm2_multiplication
run=${RUN_DIR:-/tmp/smollm2_mul_run}
mkdir -p "$out"
cat /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
python3 examples/smollm2_multiplication/prepare.py /tmp/SmolLM2-135M-Instruct.Q4_1.gguf "$EMBER_DATA"
python3 -m ember train --config-path examples/smollm2_multiplication --config-name config \
  trainer.default_local_dir="$run" "$@" 2>&1 | grep -v Warning
cp "$run"/metrics.jsonl "$run"/curves.png "$out"/
