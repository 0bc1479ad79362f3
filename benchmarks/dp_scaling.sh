#!/usr/bin/env bash
# Data-parallel scaling of a whole GRPO step: benchmarks/grpo_step.py (ember only) at 1, 2 and 4 GPUs of one
# host, the same workload (0.5B shape, 64 prompts x 8 responses x 256 tokens) and the fastest settings, each
# count in a fresh process one after the other, with one more step profiled in every process (global_profiler).
#   usage: benchmarks/dp_scaling.sh OUT_DIR [GPU_COUNT ...]      (default counts: 1 2 4)
# EXTRA_OVERRIDES (a space-separated list of `ember train` overrides) is added to every count, e.g.
# EXTRA_OVERRIDES=actor_rollout_ref.rollout.free_cache_engine=False (the KV cache kept between steps).
# Writes OUT_DIR/scaling_<count>.json (grpo_step.py's JSON), OUT_DIR/log_<count>.txt and the profiles'
# phase tables in OUT_DIR/phases_<count>.txt (every rank's, one after the other).
set -uo pipefail
out=${1:?OUT_DIR}; shift
counts=${*:-1 2 4}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for count in $counts; do
  profile=$(mktemp -d)
  extra=()
  for override in ${EXTRA_OVERRIDES:-}; do extra+=(--ember-override "$override"); done
  python "$here/grpo_step.py" --shape qwen2.5-0.5b --skip-trl --no-gradient-checkpointing --warmup 2 --steps 3 \
    --profile "$profile" --out "$out/scaling_$count.json" \
    --fast-training --ember-override trainer.n_gpus_per_node="$count" "${extra[@]}" > "$out/log_$count.txt" 2>&1
  echo "exit $? for $count GPUs" >> "$out/log_$count.txt"
  find "$profile" -name '*.phases.txt' | sort | while read -r table; do
    echo "== $table"; cat "$table"; done > "$out/phases_$count.txt"
done
