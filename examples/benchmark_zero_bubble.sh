#!/usr/bin/env bash
# The split-backward schedules beside WeiPipe and TawPipe at equal activation memory (the results in
# docs/split-backward-schedules.md, "Measured on the emulated cluster"), on the long-context model of
# examples/long_context_model.sh, the emulated cluster (2 nodes x 2 ranks, RATE links) and emulated
# compute (the runtime's split: the weight-gradient half of each backward in its weight pass):
#   1. tools/benchmark.py --equal-memory: tawpipe, weipipe, weipipe-zb1, weipipe-zb2, each at the
#      micro-batch size the simulator predicts fastest within TawPipe's activation memory (VISIT
#      micro-batches per visit); bubble (busy) and memory measured against predicted;
#   2. tawpipe-zb, run from its plan file (tools/plan.py build), at the most micro-batches per visit whose
#      predicted activations (its weight-gradient store included) fit the same budget, and its prediction.
#   sudo bash examples/benchmark_zero_bubble.sh        (REPS=1 ITERS=3 RATE=1gbit VISIT=4)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/zero_bubble}
REPS=${REPS:-1}
ITERS=${ITERS:-3}
RATE=${RATE:-1gbit}
VISIT=${VISIT:-4}
STRATEGIES=${STRATEGIES:-tawpipe weipipe weipipe-zb1 weipipe-zb2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json" --measure-activations
python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --train-iters "$ITERS" \
    --warmup-iters 1 --no-recompute --tawpipe-microbatches-per-visit "$VISIT" --equal-memory --equal-memory-rule activations \
    --schedules $STRATEGIES \
    --emulated-compute-times "$OUT/times.json" --outdir "$OUT/runs" --json "$OUT/split.json" -- "${MODEL[@]}"
python tools/benchmark.py --results "$OUT/split.json"

# tawpipe-zb: the largest visit (of VISIT, VISIT/2, ..., 1) that fits TawPipe's budget, as the simulator prices it
SIM=(--ranks 4 --groups 2 --num-layers 8 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4
     --seq-length 3072 --vocab-size 2048 --micro-batch-size 1 --num-microbatches 4 --no-recompute --dtype-bytes 4
     --intra-bw 0.6GB/s --inter-bw "$(python -c "from megatron_tawpipe.bench.equal_memory import simulator_rate; print(simulator_rate('$RATE'))")"
     --backend gloo --measured-times "$OUT/times.json")
BUDGET=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['equal_memory']['budget_bytes'])" "$OUT/split.json")
CHUNK=$VISIT
while [ "$CHUNK" -gt 1 ]; do
  ACT=$(python tools/simulate.py --schedule tawpipe-zb --chunk "$CHUNK" "${SIM[@]}" --json | python -c "import json,sys
from megatron_tawpipe.bench.equal_memory import activation_memory; print(activation_memory(json.load(sys.stdin)[0]))")
  python -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$ACT" "$BUDGET" && break
  CHUNK=$((CHUNK / 2))
done
python tools/plan.py build --schedule tawpipe-zb --chunk "$CHUNK" "${SIM[@]}" --out "$OUT/tawpipe-zb.json"
python tools/simulate.py --schedule tawpipe-zb --chunk "$CHUNK" "${SIM[@]}" --json > "$OUT/tawpipe-zb.predicted.json"
for rep in $(seq "$REPS"); do
  rm -f "$OUT/tawpipe-zb.metrics.$rep.jsonl"
  python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate "$RATE" -- pretrain_llama.py "${MODEL[@]}" \
      --num-layers 8 --pipeline-schedule "plan:$OUT/tawpipe-zb.json" --tawpipe-num-groups 2 --tawpipe-no-recompute \
      --emulated-compute-times "$OUT/times.json" --train-iters "$ITERS" --metrics-file "$OUT/tawpipe-zb.metrics.$rep.jsonl"
done
python - "$OUT" "$CHUNK" "$ITERS" <<'PY'
import glob, json, statistics, sys
from megatron_tawpipe.bench.equal_memory import activation_memory
out, chunk, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(line) for path in sorted(glob.glob(f"{out}/tawpipe-zb.metrics.*.jsonl")) for line in open(path)]
rows = [r for r in rows if r["iteration"] > 1]          # the first iteration warms up, as tools/benchmark.py skips it
pred = json.load(open(f"{out}/tawpipe-zb.predicted.json"))[0]
print(f"tawpipe-zb, {chunk} micro-batches per visit: tokens/s per rank "
      f"{statistics.median(r['tokens_per_sec_per_rank'] for r in rows):.1f} (simulated {pred['tokens_per_sec_per_rank']:.1f}), "
      f"busy {statistics.median(r['compute_busy_fraction'] for r in rows):.2f} (simulated {1 - pred['bubble_ratio']:.2f}), "
      f"peak memory {max(r['peak_memory_bytes'] for r in rows) / 1e6:.0f} MB, "
      f"held since the model {max(r.get('memory_held_since_model_bytes_max_rank') or 0 for r in rows) / 1e6:.0f} MB, "
      f"activations + logits predicted {activation_memory(pred) / 1e6:.0f} MB")
PY
