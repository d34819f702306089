#!/usr/bin/env bash
# Context parallelism on the emulated 2 x 2 cluster: CP 2 inside each node, TawPipe (the replicated first shard,
# 4 micro-batches per visit) against megatron's distributed optimizer over all ranks (overlapped reduction and
# gather), both at micro-batch 1 and global batch 16, measured side by side (whole runs alternating), each beside
# the simulator's prediction for it (tools/benchmark.py --simulate-as-run). The long-context model of
# examples/long_context_model.sh at SEQ tokens (4096 by default), emulated compute from the FLOP model at 0.4
# TFLOP/s: each layer sleeps 1/C of its time around the ring attention's real exchange of keys and values
# (megatron_tawpipe/emulation/ring.py). RATE: the node link (1 Gbit/s: commodity Ethernet between workstations or
# cloud instances without a fast interconnect).
# CP=1: the same runs without context parallelism (each GPU then runs 4 whole sequences instead of 8 halves: the
# same work per GPU and no ring), the control for what the prediction misses besides the ring.
# EXTRA: more pretrain_llama.py flags for both strategies (e.g. EXTRA=--bf16: bf16 weights and keys/values).
#   sudo bash examples/benchmark_context_parallel.sh          (ROUNDS=3 REPS=1 RATE=1gbit SEQ=4096 VISIT=4 CP=2)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/context_parallel}
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-1}
RATE=${RATE:-1gbit}
SEQ=${SEQ:-4096}
VISIT=${VISIT:-4}
CP=${CP:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
CP_MODEL=()   # MODEL at SEQ tokens, CP CP
for ((i = 0; i < ${#MODEL[@]}; i++)); do
    case "${MODEL[i]}" in
        --seq-length|--max-position-embeddings) CP_MODEL+=("${MODEL[i]}" "$SEQ"); i=$((i + 1)) ;;
        *) CP_MODEL+=("${MODEL[i]}") ;;
    esac
done
[ "$CP" = 1 ] || CP_MODEL+=(--context-parallel-size "$CP")
read -r -a EXTRA_FLAGS <<< "${EXTRA:-}"
CP_MODEL+=(${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"})
mkdir -p "$OUT"
calibrate_times "$OUT/times.json" --seq-length "$SEQ"
COMMON=(--nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --train-iters 4 --warmup-iters 1
        --no-recompute --emulated-compute-times "$OUT/times.json" --timeout 900)
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round distopt $(date -u +%FT%TZ) loadavg $(cat /proc/loadavg)" >> "$OUT/loadavg.txt"
  python tools/benchmark.py "${COMMON[@]}" --schedules distopt --ddp-bucket-size 1000000 \
      --outdir "$OUT/distopt-$round/runs" --json "$OUT/distopt-$round.json" -- "${CP_MODEL[@]}"
  echo "round $round tawpipe-rep $(date -u +%FT%TZ) loadavg $(cat /proc/loadavg)" >> "$OUT/loadavg.txt"
  python tools/benchmark.py "${COMMON[@]}" --schedules tawpipe-rep --tawpipe-microbatches-per-visit "$VISIT" \
      --outdir "$OUT/tawpipe-rep-$round/runs" --json "$OUT/tawpipe-rep-$round.json" -- "${CP_MODEL[@]}"
done
for name in distopt tawpipe-rep; do
  python tools/benchmark.py --results "$OUT/$name-1.json" --simulate-as-run "$OUT/$name-simulated.json"
done
python tools/context_parallel_report.py "$OUT" "$ROUNDS" distopt tawpipe-rep
