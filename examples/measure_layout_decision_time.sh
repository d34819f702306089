#!/usr/bin/env bash
# How long a TawPipe run's layout decision takes at start-up ("N layouts priced in X s" of the run's layout line),
# the link given (no probe), the long-context model of examples/long_context_model.sh with emulated compute,
# one iteration; this tree, and with BASE=DIR another checkout beside it, alternating, REPS times.
#   NPROC=8 NG=4 LAYERS=16 GBS=32 LWS=2 BASE=/tmp/old bash examples/measure_layout_decision_time.sh
# NPROC ranks in NG groups (LWS ranks per node, torchrun's LOCAL_WORLD_SIZE), LAYERS layers, GBS samples.
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)
export OMP_NUM_THREADS=1
source examples/long_context_model.sh
TIMES=$(mktemp) && trap 'rm -f "$TIMES"' EXIT
calibrate_times "$TIMES" >/dev/null 2>&1
model_with "${LAYERS:-16}" "${GBS:-32}"
for rep in $(seq "${REPS:-3}"); do
    for tree in ${BASE:-} "$HERE"; do
        line=$(PYTHONPATH=$tree LOCAL_WORLD_SIZE=${LWS:-2} torchrun --nproc-per-node "${NPROC:-8}" \
            --master-port "${MASTER_PORT:-29561}" "$tree/pretrain_llama.py" "${CELL_MODEL[@]}" --pipeline-schedule tawpipe \
            --tawpipe-num-groups "${NG:-4}" --emulated-compute-times "$TIMES" --tawpipe-link-bandwidth 300Mbit/s \
            --tawpipe-link-latency 100us --train-iters 1 2>&1 | grep "tawpipe layout:" | head -1)
        echo "$tree: $(grep -oE '[0-9]+ layouts priced in [0-9.]+ s' <<<"$line")"
    done
done
