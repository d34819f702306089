#!/usr/bin/env bash
# TawPipe as a user runs it (--pipeline-schedule tawpipe, no layout flag: the run decides its layout) against
# megatron's distributed optimizer and the best hand-set TawPipe layout (spread, two shards per rank, 4
# micro-batches per visit), on emulated clusters of 3 x 2 and 4 x 2 ranks (root: network namespaces, htb-shaped
# node links), the long-context model of examples/long_context_model.sh with 12 layers, 4 samples per rank,
# emulated compute; then the simulator's figures for the same runs.
#   sudo bash examples/benchmark_auto_layout.sh                     (every cell below)
#   CELLS="3:2:300mbit:4" REPS=2 sudo bash examples/benchmark_auto_layout.sh
# A cell is NODES:RANKS_PER_NODE:RATE:DISTOPT_MICRO_BATCH; the last is the distributed optimizer's micro-batch
# size, or "equal" for the benchmark's equal-whole-memory rule (the largest the simulator says fits in what
# TawPipe holds). On 3 x 2 it runs micro-batches of 4 (its footprint is within 0.3% of TawPipe's; the rule would
# hold it to 2 by a few MB), on 4 x 2 the rule's 2 (4 would exceed TawPipe's memory).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/auto_layout}
REPS=${REPS:-2}
ITERS=${ITERS:-4}
CELLS=${CELLS:-"3:2:300mbit:4 3:2:150mbit:4 4:2:300mbit:equal 4:2:150mbit:equal"}
STRATEGIES=${STRATEGIES:-tawpipe tawpipe-spread distopt}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
for cell in $CELLS; do
    IFS=: read -r nodes per_node rate distopt_mb <<< "$cell"
    name="${nodes}x${per_node}_${rate}"
    gbs=$((nodes * per_node * 4))
    distopt=()
    [ "$distopt_mb" = equal ] || distopt=(--micro-batch-size-of "distopt=$distopt_mb")
    python tools/benchmark.py --nodes "$nodes" --ranks-per-node "$per_node" --rate "$rate" --repetitions "$REPS" \
        --schedules $STRATEGIES --train-iters "$ITERS" --warmup-iters 1 --no-recompute \
        --tawpipe-microbatches-per-visit 4 --tawpipe-shards-per-rank 2 --ddp-bucket-size 1000000 \
        --equal-memory "${distopt[@]}" --emulated-compute-times "$OUT/times.json" \
        --outdir "$OUT/$name/runs" --json "$OUT/$name/results.json" --timeout 600 \
        -- "${MODEL[@]}" --num-layers 12 --global-batch-size "$gbs"
    python tools/benchmark.py --results "$OUT/$name/results.json" --simulate-as-run "$OUT/$name/simulated.json"
done
