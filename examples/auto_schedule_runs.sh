#!/usr/bin/env bash
# --pipeline-schedule auto on the long-context model of examples/long_context_model.sh (two layers and 4 samples per
# rank, emulated compute, micro-batch 1): on an emulated cluster (root: network namespaces, htb-shaped node links)
# or, with RATE=none, on one node of RANKS ranks; 2 iterations of whatever it picks. Writes the run's output to
# examples/results/auto_schedule_${NODES}x${PER_NODE}_${RATE}.txt.
#   NODES=2 PER_NODE=2 RATE=1gbit sudo bash examples/auto_schedule_runs.sh
#   NODES=1 PER_NODE=4 RATE=none bash examples/auto_schedule_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-2}
PER_NODE=${PER_NODE:-2}
RATE=${RATE:-1gbit}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
OUT=examples/results/auto_schedule_${NODES}x${PER_NODE}_${RATE}.txt
TIMES=runs/auto_schedule_times.json
mkdir -p runs && calibrate_times "$TIMES" >/dev/null
ranks=$((NODES * PER_NODE))
model_with "$((ranks * 2))" "$((ranks * 4))"
ARGS=("${CELL_MODEL[@]}" --pipeline-schedule auto --emulated-compute-times "$TIMES" --train-iters 2)
if [ "$RATE" = none ]; then
    torchrun --nproc-per-node "$ranks" --master-port "${MASTER_PORT:-29571}" pretrain_llama.py "${ARGS[@]}" 2>&1 |
        grep -v "Warning\|warnings.warn\|MockGPTDataset" | tee "$OUT"
else
    python tools/emulated_cluster.py --nodes "$NODES" --ranks-per-node "$PER_NODE" --rate "$RATE" -- \
        pretrain_llama.py "${ARGS[@]}" 2>&1 | grep -v "Warning\|warnings.warn\|MockGPTDataset" | tee "$OUT"
fi
