#!/usr/bin/env bash
# The real training loop (benchmarks/ddp_scaling.py, one GPU) once per loss configuration named: clips/s and peak
# memory, one JSON line each in $OUT/loss_terms.jsonl, the end of each run's log in $OUT/loss_terms.log (not a
# test). Run folders and whole logs stay under $RUNS (default /tmp/loss_terms_runs).
#
#   benchmarks/loss_terms.sh [--prewarm K] NAME...
#
# NAMEs: base (L1 + perceptual), gram, high_freq, consistency, flow, official (the cosmos_finetune recipe's terms:
# perceptual + Gram + flow), all, gan, gan_every8 (the adaptive weight every 8 steps), anchor (the latent anchor: a
# frozen base encoder's pass a step), l1, l1_anchor (the anchor's cost against L1 alone), dv_base, dv_gan,
# dv_gan_every8 (DV8x16x16).
# Every run: CV8x8x8 unless named dv_*, 33x256x256 clips, batch 8, compiled, channels-last, CUDA graphs,
# random VGG16/RAFT weights. --prewarm K first runs every configuration for 3 steps, K at a
# time, only to fill Inductor's cache, so that the timed runs, one after the other, spend less time compiling.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/loss_terms}
runs=${RUNS:-/tmp/loss_terms_runs}
mkdir -p "$out" "$runs"
prewarm=0
if [[ ${1:-} == --prewarm ]]; then prewarm=$2; shift 2; fi

# LOOP and FAST replace the defaults (e.g. a small CPU try: LOOP="--size 128 --micro-batch 1 ..." FAST="").
loop="benchmarks/ddp_scaling.py ${LOOP:---micro-batch 8 --workers 12 --cached-clips 48}"
fast=${FAST-model.compile=true model.channels_last=true model.cuda_graphs=true}
gram="loss.gram.weight=0.062"
flow="loss.flow.weight=0.01"
consistency="loss.consistency.weight=1.0 loss.consistency.window=17 loss.consistency.step=8"
gan="loss.gan.weight=0.1"
declare -A args=(
  [base]="--perceptual"
  [gram]="--perceptual $gram"
  [high_freq]="--perceptual loss.high_freq.weight=0.1"
  [consistency]="--perceptual $consistency"
  [flow]="--perceptual $flow"
  [official]="--perceptual $gram $flow"
  [all]="--perceptual $gram $flow loss.high_freq.weight=0.1 $consistency"
  [gan]="--perceptual $gan"
  [gan_every8]="--perceptual $gan loss.gan.adaptive_every=8"
  [anchor]="--perceptual loss.latent_anchor.weight=0.1"
  [l1]=""
  [l1_anchor]="loss.latent_anchor.weight=0.1"
  [dv_base]="--model DV8x16x16 --perceptual"
  [dv_gan]="--model DV8x16x16 --perceptual $gan"
  [dv_gan_every8]="--model DV8x16x16 --perceptual $gan loss.gan.adaptive_every=8"
)
for name in "$@"; do
  [[ -n ${args[$name]+set} ]] || { echo "loss_terms.sh: unknown configuration '$name' (known: ${!args[*]})" >&2; exit 2; }
done

run() {  # name steps warmup port folder
  # shellcheck disable=SC2086  # the argument strings are word lists
  torchrun --nproc-per-node 1 --master-port "$4" $loop --out "$5" --steps "$2" --warmup "$3" ${args[$1]} $fast
}

if ((prewarm > 0)); then
  start=$(date +%s)
  port=29600
  for name in "$@"; do
    run "$name" 3 0 $((port++)) "$runs/prewarm" >"$runs/prewarm_$name.log" 2>&1 &
    while (($(jobs -rp | wc -l) >= prewarm)); do wait -n; done
  done
  wait
  echo "{\"prewarm_s\": $(($(date +%s) - start)), \"names\": \"$*\"}" | tee -a "$out/loss_terms.jsonl"
fi
for name in "$@"; do
  start=$(date +%s)
  # A fresh run folder each time: a run cut short (a timeout) must not leave its checkpoints or lock to the next.
  folder=$(mktemp -d "$runs/timed_${name}_XXXX")
  run "$name" 40 20 29500 "$folder" >"$runs/$name.log" 2>&1
  # The rank's own error lines (above torchrun's traceback, which the tail alone would show), then the end.
  { echo "=== $name"; grep -E '^[A-Za-z_.]*(Error|Exception|Busy)\b|^(RuntimeError|ValueError)' "$runs/$name.log" | head -n 5
    tail -n 40 "$runs/$name.log"; } >>"$out/loss_terms.log"
  line=$(grep -E '^\{"run"' "$runs/$name.log" | tail -1)
  echo "{\"name\": \"$name\", \"wall_s\": $(($(date +%s) - start)), \"result\": ${line:-null}}" | tee -a "$out/loss_terms.jsonl"
done
