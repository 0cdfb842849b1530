#!/usr/bin/env bash
# The real training loop on real footage, beside the same loop on synthetic cached clips (issue 19; not a test).
# Runs benchmarks/ddp_scaling.py (train() itself, one GPU) once per dataset, loss and loader-worker count, on
# shards that benchmarks/footage.py makes from the 720p sample; one JSON line per run in
# $OUT/real_footage.jsonl (clips/s, the loop's wait for the loader, host cores busy, loader memory at the start
# and end of the timed steps), the ends of the logs in $OUT/real_footage.log.
#
#   benchmarks/real_footage.sh [--sample FILE] [--copies N] [--workers "4 8 12"] [--losses "l1 perceptual"]
#                              [--data "synthetic transcoded long-gop long-gop-keyframe ..."]
#
# Datasets (built once under $WORK, default /tmp/real_footage): transcoded (720p after make-shards --transcode),
# long-gop (1080p, a keyframe every 250 frames, as shipped), long-gop-keyframe (the same with data.start=keyframe),
# transcoded-gpu and long-gop-gpu (decoded by NVDEC: data.decode=gpu), synthetic (48 clips made once per worker,
# served from memory). Every run: CV8x8x8, 33x256x256 clips (long-gop:
# short side resized to 256 while decoding), batch 8, compiled, channels-last, CUDA graphs, 40 steps of which the
# first 20 are left out; runs of one loss share one compile cache, so only the first compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/real_footage_out}
work=${WORK:-/tmp/real_footage}
sample=.bench_media/bigbuckbunny.mp4
copies=400
workers="4 8 12"
losses="l1 perceptual"
data="synthetic transcoded long-gop long-gop-keyframe"
steps=${STEPS:-40}
warmup=${WARMUP:-20}
while (($#)); do
  case $1 in
    --sample) sample=$2 ;;
    --copies) copies=$2 ;;
    --workers) workers=$2 ;;
    --losses) losses=$2 ;;
    --data) data=$2 ;;
    *) echo "real_footage.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift 2
done
mkdir -p "$out" "$work"
[[ -f $sample ]] || { echo "real_footage.sh: no sample video at $sample (carry .bench_media, or --sample FILE)" >&2; exit 2; }
# LOOP and FAST replace the defaults (e.g. a small CPU try: LOOP="--size 64 --micro-batch 1 --frames 9" FAST="").
loop="benchmarks/ddp_scaling.py ${LOOP:---micro-batch 8}"
fast=${FAST-model.compile=true model.channels_last=true model.cuda_graphs=true}
extra=${EXTRA:-}  # more overrides for every run, e.g. EXTRA="data.prefetch=6"

needed=()
for name in $data; do
  case $name in
    transcoded | transcoded-gpu) needed+=(transcoded) ;;
    long-gop | long-gop-keyframe | long-gop-gpu) needed+=(long-gop) ;;
    synthetic) ;;
    *) echo "real_footage.sh: unknown dataset '$name'" >&2; exit 2 ;;
  esac
done
if ((${#needed[@]})); then
  began=$(date +%s)
  mapfile -t unique < <(printf '%s\n' "${needed[@]}" | sort -u)
  python3 benchmarks/footage.py "$sample" "$work/datasets" --copies "$copies" --data "${unique[@]}" ||
    { echo "real_footage.sh: building the datasets failed" >&2; exit 1; }
  echo "{\"built\": \"${unique[*]}\", \"copies\": $copies, \"build_s\": $(($(date +%s) - began))}" |
    tee -a "$out/real_footage.jsonl"
fi

for loss in $losses; do
  flag=""
  [[ $loss == perceptual ]] && flag=--perceptual
  for name in $data; do
    case $name in
      synthetic) source="--cached-clips 48" ;;
      transcoded) source="data.path=$work/datasets/transcoded/shards" ;;
      long-gop) source="data.path=$work/datasets/long-gop/shards data.resize_short_side=256" ;;
      long-gop-keyframe)
        source="data.path=$work/datasets/long-gop/shards data.resize_short_side=256 data.start=keyframe" ;;
      transcoded-gpu) source="data.path=$work/datasets/transcoded/shards data.decode=gpu" ;;
      long-gop-gpu) source="data.path=$work/datasets/long-gop/shards data.resize_short_side=256 data.decode=gpu" ;;
    esac
    for w in $workers; do
      began=$(date +%s)
      folder=$(mktemp -d "$work/run_XXXX")
      log="$folder.log"
      # shellcheck disable=SC2086  # word lists
      torchrun --nproc-per-node 1 $loop --workers "$w" --steps "$steps" --warmup "$warmup" --out "$folder" \
        $flag $source $fast $extra "model.compile_cache=$work/compile_cache_$loss" >"$log" 2>&1
      line=$(grep -E '^\{"run"' "$log" | tail -1)
      echo "{\"data\": \"$name\", \"loss\": \"$loss\", \"workers\": $w, \"extra\": \"$extra\", \"wall_s\": $(($(date +%s) - began)), \"result\": ${line:-null}}" |
        tee -a "$out/real_footage.jsonl"
      { echo "=== $name $loss $w"; grep -E '^[A-Za-z_.]*(Error|Exception|Busy)\b' "$log" | head -n 5
        tail -n 15 "$log"; } >>"$out/real_footage.log"
      rm -rf "$folder"
    done
  done
done
