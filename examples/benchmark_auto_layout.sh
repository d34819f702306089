#!/usr/bin/env bash
# TawPipe as a user runs it (--pipeline-schedule tawpipe, no layout flag: the run decides its layout) against
# megatron's distributed optimizer and the best hand-set TawPipe layout (spread, two shards per rank, 4
# micro-batches per visit), on emulated clusters of 3 x 2 and 4 x 2 ranks (root: network namespaces, htb-shaped
# node links), the long-context model of examples/long_context_model.sh with two layers per rank (12 on 3 x 2, 16
# on 4 x 2), 4 samples per rank,
# emulated compute (weight passing recomputes as a plain run decides, RECOMPUTE=auto: activations kept where they
# fit, as the native strategies keep theirs); then the simulator's figures for the same runs.
#   sudo bash examples/benchmark_auto_layout.sh                     (every cell below)
# What --pipeline-schedule auto ranked first on 2 x 2 at 1 Gbit/s and one node (examples/auto_schedule_runs.sh),
# every strategy at micro-batch 1:
#   CELLS="2:2:1gbit:equal" STRATEGIES="distopt distopt-node tawpipe" EQUAL="" sudo bash examples/benchmark_auto_layout.sh
#   CELLS="1:4:none:equal" STRATEGIES="distopt interleaved 1f1b" EQUAL="" sudo bash examples/benchmark_auto_layout.sh
#   CELLS="3:2:300mbit:4" REPS=2 sudo bash examples/benchmark_auto_layout.sh
# Against the layout --pipeline-schedule tawpipe ran by default before it was decided (one owner per shard, the
# cache, one micro-batch per visit), on 2 x 2 at 1 Gbit/s and on one node of 4 ranks (no link to emulate):
#   CELLS="2:2:1gbit:equal 1:4:none:equal" STRATEGIES="tawpipe tawpipe-owner" VARIANT_FLAGS="" \
#       sudo bash examples/benchmark_auto_layout.sh
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
# --equal-memory (the default) gives each strategy the micro-batch size its memory allows; EQUAL="" runs every
# strategy at the model's micro-batch size 1 (the cell's DISTOPT_MICRO_BATCH is then ignored: give "equal")
EQUAL=${EQUAL---equal-memory}
# the named variants' layout (tawpipe itself takes none: the run decides it)
VARIANT_FLAGS=${VARIANT_FLAGS-"--tawpipe-microbatches-per-visit 4 --tawpipe-shards-per-rank 2"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
for cell in $CELLS; do
    IFS=: read -r nodes per_node rate distopt_mb <<< "$cell"
    name="${nodes}x${per_node}_${rate}"
    gbs=$((nodes * per_node * 4))
    layers=$((nodes * per_node * 2))
    model_with "$layers" "$gbs"   # CELL_MODEL: MODEL with two layers and 4 samples per rank
    distopt=()
    [ "$distopt_mb" = equal ] || distopt=(--micro-batch-size-of "distopt=$distopt_mb")
    if [ "$nodes" = 1 ]; then where=(--ranks "$per_node" --groups 1); else
        where=(--nodes "$nodes" --ranks-per-node "$per_node" --rate "$rate"); fi
    python tools/benchmark.py "${where[@]}" --repetitions "$REPS" \
        --schedules $STRATEGIES --train-iters "$ITERS" --warmup-iters 1 --recompute "${RECOMPUTE:-auto}" \
        $VARIANT_FLAGS --ddp-bucket-size 1000000 \
        $EQUAL "${distopt[@]}" --emulated-compute-times "$OUT/times.json" \
        --outdir "$OUT/$name/runs" --json "$OUT/$name/results.json" --timeout 600 \
        -- "${CELL_MODEL[@]}"
    python tools/benchmark.py --results "$OUT/$name/results.json" --simulate-as-run "$OUT/$name/simulated.json"
done
