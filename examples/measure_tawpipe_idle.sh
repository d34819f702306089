#!/usr/bin/env bash
# TawPipe's iteration, category by category, on the emulated 2 x 1 and 2 x 2 clusters (root: network
# namespaces), with and without the replicated first shard; then tools/idle_breakdown.py beside the
# simulator. docs/tawpipe-idle.md has the tables. OUT: where the runs go (default runs/idle_quiet).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/long_context_model.sh
OUT=${OUT:-runs/idle_quiet}
mkdir -p "$OUT"
calibrate_times "$OUT/times.json" >/dev/null
run() {  # name, ranks per node, extra flags
  local name=$1 R=$2; shift 2
  echo "== $name (load $(cut -d' ' -f1-3 /proc/loadavg))"
  OMP_NUM_THREADS=1 python tools/emulated_cluster.py --nodes 2 --ranks-per-node "$R" --rate 300mbit -- \
    pretrain_llama.py "${MODEL[@]}" --pipeline-schedule tawpipe --tawpipe-num-groups 2 \
    --tawpipe-microbatches-per-visit 4 --tawpipe-no-recompute --emulated-compute-times "$OUT/times.json" \
    --train-iters 3 --timeline-file "$OUT/$name.timeline.json" --metrics-file "$OUT/$name.metrics.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  local ranks=$((2 * R)) sched=tawpipe rep=()
  if [[ " $* " == *" --tawpipe-replicate-first-shard "* ]]; then sched=tawpipe-rep; rep=(--replicate-first-shard); fi
  python tools/idle_breakdown.py --timeline "$OUT/$name.timeline.json" --schedule "$sched" --ranks "$ranks" \
    --groups 2 --num-layers 8 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4 --seq-length 3072 \
    --num-microbatches $((16 / ranks)) --chunk 4 --vocab-size 2048 --dtype-bytes 4 --no-recompute \
    --measured-times "$OUT/times.json" --inter-bw 300Mbit/s --intra-bw 0.6GB/s --backend gloo "${rep[@]}"
}
run rep_2x1 1 --tawpipe-replicate-first-shard
run plain_2x1 1
run rep_2x2 2 --tawpipe-replicate-first-shard
