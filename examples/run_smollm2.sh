#!/usr/bin/env bash
# On the GPU host, from the repository's root: rejoin the SmolLM2 GGUF pieces (/tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part*),
# prepare an example's model and data, train with its config, copy the curve and metrics to OUT.
#   bash examples/run_smollm2.sh EXAMPLE OUT [ember train arguments...]     (EXAMPLE: a folder of examples/)
# RUN_DIR (default /tmp/EXAMPLE_run) is the run's folder: give each variant its own, or the second run resumes
# from the first one's checkpoint. The last --config-name given wins (e.g. --config-name config_lora).
set -euo pipefail
example=${1:?example folder}; out=${2:?output folder}; shift 2
export EMBER_DATA=/tmp/$example
run=${RUN_DIR:-/tmp/${example}_run}
mkdir -p "$out"
cat /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
python3 "examples/$example/prepare.py" /tmp/SmolLM2-135M-Instruct.Q4_1.gguf "$EMBER_DATA"
python3 -m ember train --config-path "examples/$example" --config-name config \
  trainer.default_local_dir="$run" "$@" 2>&1 | grep -v Warning
cp "$run"/metrics.jsonl "$run"/curves.png "$out"/
