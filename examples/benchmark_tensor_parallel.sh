#!/usr/bin/env bash
# TawPipe with and without tensor parallelism inside the nodes, on the emulated cluster of 2 nodes x 2
# ranks (root: network namespaces, htb-shaped node links) with the long-context model and emulated
# compute of examples/benchmark_long_context.sh: `tawpipe` (T = 1: 4 ranks, one shard each) against
# `tawpipe-tp` (T = 2: 2 virtual ranks, one per node, each rank holding half of every shard, with
# --sequence-parallel). Bytes on the node links per iteration and tokens/s per rank for both, then
# the simulator's prediction of the same two runs.
#   sudo bash examples/benchmark_tensor_parallel.sh        (REPS=3 ITERS=4 RATE=1gbit VISIT=4)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/tensor_parallel}
REPS=${REPS:-3}
ITERS=${ITERS:-4}
RATE=${RATE:-1gbit}
INTER_BW=${INTER_BW:-125MB/s}
INTRA_BW=${INTRA_BW:-0.6GB/s}
VISIT=${VISIT:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --schedules tawpipe tawpipe-tp \
    --train-iters "$ITERS" --warmup-iters 1 --no-recompute --tawpipe-microbatches-per-visit "$VISIT" \
    --emulated-compute-times "$OUT/times.json" --outdir "$OUT/runs" --json "$OUT/results.json" -- "${MODEL[@]}"
for tp in 1 2; do
  python tools/simulate.py --schedule tawpipe --ranks 4 --groups 2 --num-layers 8 --hidden-size 256 --num-attention-heads 4 \
      --seq-length 3072 --micro-batch-size 1 --num-microbatches $((4 * tp)) --vocab-size 2048 --dtype-bytes 4 --no-recompute \
      --chunk "$VISIT" --measured-times "$OUT/times.json" --intra-bw "$INTRA_BW" --inter-bw "$INTER_BW" --backend gloo \
      --tensor-model-parallel-size "$tp" --json > "$OUT/simulated_tp$tp.json"
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for tp in (1, 2):
    (row,) = json.load(open(f"{out}/simulated_tp{tp}.json"))
    print(f"simulated T={tp}: {row['tokens_per_sec_per_rank']:.0f} tokens/s per rank, "
          f"{row['inter_group_bytes'] / 1e6:.1f} MB between nodes per iteration, busy {1 - row['bubble_ratio']:.2f}")
PY
