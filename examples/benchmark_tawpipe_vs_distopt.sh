#!/usr/bin/env bash
# The main table's closest pair measured side by side, alternating whole runs: megatron's distributed
# optimizer over all ranks at micro-batch size 4 (what TawPipe's visit of 4 micro-batches holds), TawPipe
# with the replicated first shard at the default layer split ([2,2,2,2]) and with a smaller shard 0
# ([1,2,2,3]), on the emulated 2 x 2 cluster and long-context model of examples/benchmark_long_context.sh.
# DISTOPT=0 runs the two TawPipe splits only.
#   sudo bash examples/benchmark_tawpipe_vs_distopt.sh        (ROUNDS=3 REPS=2 RATE=1gbit VISIT=4 DISTOPT=1)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/tawpipe_vs_distopt}
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-2}
RATE=${RATE:-1gbit}
VISIT=${VISIT:-4}
DISTOPT=${DISTOPT:-1}
NAMES="rep2222 rep1223"
[ "$DISTOPT" = 1 ] && NAMES="distopt $NAMES"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
COMMON=(--nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --train-iters 4 --warmup-iters 1
        --no-recompute --emulated-compute-times "$OUT/times.json")
for round in $(seq 1 "$ROUNDS"); do
  [ "$DISTOPT" = 1 ] && python tools/benchmark.py "${COMMON[@]}" --schedules distopt --micro-batch-size-of distopt=4 --ddp-bucket-size 1000000 \
      --outdir "$OUT/distopt-$round/runs" --json "$OUT/distopt-$round.json" -- "${MODEL[@]}"
  python tools/benchmark.py "${COMMON[@]}" --schedules tawpipe-rep --tawpipe-microbatches-per-visit "$VISIT" \
      --outdir "$OUT/rep2222-$round/runs" --json "$OUT/rep2222-$round.json" -- "${MODEL[@]}"
  python tools/benchmark.py "${COMMON[@]}" --schedules tawpipe-rep --tawpipe-microbatches-per-visit "$VISIT" \
      --outdir "$OUT/rep1223-$round/runs" --json "$OUT/rep1223-$round.json" \
      -- "${MODEL[@]}" --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3
done
python - "$OUT" "$ROUNDS" $NAMES <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for name in sys.argv[3:]:
    runs = [r for k in range(1, rounds + 1) for r in json.load(open(f"{out}/{name}-{k}.json"))["runs"]]
    tps = [r["tokens_per_sec_per_rank"] for r in runs]
    busy = [r["compute_busy_fraction"] for r in runs]
    print(f"{name}: median {statistics.median(tps):.1f} tokens/s per rank ({min(tps):.0f}-{max(tps):.0f}, "
          f"{len(tps)} runs), busy {statistics.median(busy):.3f}")
PY
