#!/usr/bin/env bash
# WeiPipe's zero-bubble variants beside WeiPipe and TawPipe at equal activation memory (the results in
# docs/benchmarks-options.md, "WeiPipe's zero-bubble variants"), on the long-context model of
# examples/benchmark_long_context.sh:
#   1. emulated cluster (2 nodes x 2 ranks, 1 Gbit/s), split backwards as the runtime computes them
#      (the weight-gradient kernels in the input pass): bubble (busy) measured against predicted;
#   2. the same with the weight-gradient kernels deferred to the weight pass (emulated only:
#      --deferred-weight-gradients), what the plans are built for;
#   3. real compute on the same emulated cluster, each strategy at the micro-batch size of run 1,
#      --record-plan-memory: what each plan's compute held against the memory model, priced with one
#      layer's activation bytes measured on this machine (its speeds are the CPU's, not the device's).
#   sudo bash examples/benchmark_zero_bubble.sh        (REPS=3 ITERS=4 RATE=1gbit VISIT=4)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/zero_bubble}
REPS=${REPS:-3}
ITERS=${ITERS:-4}
RATE=${RATE:-1gbit}
VISIT=${VISIT:-4}
STRATEGIES=${STRATEGIES:-tawpipe weipipe weipipe-zb1 weipipe-zb2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json" --measure-activations
COMMON=(--train-iters "$ITERS" --warmup-iters 1 --no-recompute --tawpipe-microbatches-per-visit "$VISIT"
        --equal-memory --schedules $STRATEGIES)
for mode in built deferred; do
  DEFER=()
  [ "$mode" = deferred ] && DEFER=(--deferred-weight-gradients)
  python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" "${COMMON[@]}" \
      "${DEFER[@]}" --emulated-compute-times "$OUT/times.json" --outdir "$OUT/$mode/runs" \
      --json "$OUT/$mode.json" -- "${MODEL[@]}"
  python tools/benchmark.py --results "$OUT/$mode.json"
done
SIZES=($(python -c "import json,sys; r=json.load(open(sys.argv[1]))['equal_memory']['choices']
print(' '.join(f'--micro-batch-size-of {s}={c[\"micro_batch_size\"]}' for s, c in r.items()))" "$OUT/built.json"))
python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions 1 "${COMMON[@]}" "${SIZES[@]}" --train-iters 3 \
    --record-plan-memory --measured-times "$OUT/times.json" --outdir "$OUT/memory/runs" --json "$OUT/memory.json" \
    -- "${MODEL[@]}"
python tools/benchmark.py --results "$OUT/memory.json"
