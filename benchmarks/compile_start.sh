#!/usr/bin/env bash
# How long the first training step takes with model.compile: a cold start, a warm start on the same machine, and
# the requeue case (a fresh Inductor folder, as on another node, with the run's compile cache), for one clip shape.
# Runs benchmarks/ddp_scaling.py (train() itself) three times on one GPU and prints the "first step" line each
# run's summary gives, one JSON line per start in $OUT/compile_start.jsonl (not a test).
#
#   benchmarks/compile_start.sh [ddp_scaling.py arguments...]
#   e.g. benchmarks/compile_start.sh --micro-batch 8 --frames 33 --size 256
#        benchmarks/compile_start.sh --micro-batch 1 --frames 33 --size 720 --width 1280 \
#          model.activation_checkpointing=true
#
# The three runs share one explicit model.compile_cache folder, so
# each is a new run folder (nothing resumes) while the cache carries over as it does for one run relaunched.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/compile_start}
work=${WORK:-/tmp/compile_start_work}
rm -rf "$work" && mkdir -p "$out" "$work"
fast="model.compile=true model.channels_last=true model.cuda_graphs=true model.compile_cache=$work/compile_cache"

start() {  # name inductor-folder ddp_scaling-arguments...
  local name=$1 folder=$2 began log="$work/$1.log"
  shift 2
  began=$(date +%s)
  # shellcheck disable=SC2086  # $fast is a word list
  TORCHINDUCTOR_CACHE_DIR="$folder" torchrun --nproc-per-node 1 benchmarks/ddp_scaling.py --steps 6 --warmup 3 \
    --workers 8 --cached-clips 16 --out "$work/runs_$name" "$@" $fast >"$log" 2>&1
  local rc=$? first
  first=$(grep -m1 -oE 'first step: [0-9.]+ s \([^)]*\)' "$log" | sed 's/"/\\"/g')
  echo "{\"start\": \"$name\", \"rc\": $rc, \"wall_s\": $(($(date +%s) - began)), \"summary\": \"${first:-none}\"}" |
    tee -a "$out/compile_start.jsonl"
  { echo "=== $name"; grep -E 'compile cache|compiling the training step|first step|Error|error:' "$log"; } >>"$out/compile_start.log"
}

start cold "$work/inductor_a" "$@"
start warm "$work/inductor_a" "$@"
start requeue "$work/inductor_b" "$@"
