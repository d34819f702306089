#!/usr/bin/env bash
# TawPipe with the replicated first shard, default layer split ([2,2,2,2]) against a smaller shard 0
# ([1,2,2,3]: --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3), alternating,
# on the emulated 2 x 2 cluster and long-context model of examples/benchmark_long_context.sh. The
# replicated shard 0 is what every node starts on and what its holders all-reduce after the last
# backward: a smaller one shortens both waits.
#   sudo bash examples/benchmark_first_shard_split.sh        (ROUNDS=2 REPS=2 RATE=1gbit VISIT=4)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/first_shard_split}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-2}
RATE=${RATE:-1gbit}
VISIT=${VISIT:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
for round in $(seq 1 "$ROUNDS"); do
  for split in 2222 1223; do
    SPLIT=()
    [ "$split" = 1223 ] && SPLIT=(--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3)
    python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --schedules tawpipe-rep \
        --train-iters 4 --warmup-iters 1 --no-recompute --tawpipe-microbatches-per-visit "$VISIT" \
        --emulated-compute-times "$OUT/times.json" --outdir "$OUT/$split-$round/runs" --json "$OUT/$split-$round.json" \
        -- "${MODEL[@]}" "${SPLIT[@]}"
  done
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for split in ("2222", "1223"):
    runs = [r for k in range(1, rounds + 1) for r in json.load(open(f"{out}/{split}-{k}.json"))["runs"]]
    tps = [r["tokens_per_sec_per_rank"] for r in runs]
    busy = [r["compute_busy_fraction"] for r in runs]
    print(f"[{','.join(split)}]: {statistics.median(tps):.1f} tokens/s per rank ({min(tps):.0f}-{max(tps):.0f}, "
          f"{len(tps)} runs), busy {statistics.median(busy):.3f}")
PY
