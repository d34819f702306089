#!/usr/bin/env bash
# The results in docs/benchmarks-and-results.md: TawPipe and WeiPipe against what practitioners would run instead (each
# configured as its users would: see tools/benchmark.py --help): native Megatron 1F1B / interleaved
# over all ranks, 1F1B with one stage per node and the distributed optimizer inside, the distributed
# optimizer with one instance per node and over all ranks, FSDP2 and HSDP, on an
# emulated cluster of 2 nodes x 2 ranks (root: network namespaces, htb-shaped node links),
# long context (G*S/(12H) = 1*3072/(12*256) = 1 (G = micro-batch size 1)), emulated compute calibrated so that one
# shard's weights (2 layers, fp32, 6.4 MB) take about as long on the node link as one
# shard's forward (2 x 24.4 ms). Then the simulator's prediction of the same configuration.
#   sudo bash examples/benchmark_long_context.sh        (REPS=3 ITERS=4 RATE=1gbit VISIT=4)
# tawpipe-rep: TawPipe with --tawpipe-replicate-first-shard (shard 0 in both nodes).
# At equal memory (EQUAL_MEMORY=1, the default): each strategy runs the micro-batch size the simulator
# predicts fastest among those whose memory fits what TawPipe holds (tools/benchmark.py --equal-memory):
# the whole footprint (EQUAL_MEMORY_RULE=whole, the default: weights, gradients, optimizer state, buffers,
# activations) or activations only (EQUAL_MEMORY_RULE=activations, the rule of the runs before 2026-11-28);
# EQUAL_MEMORY=0 runs every strategy at micro-batch size 1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/long_context}
REPS=${REPS:-3}
ITERS=${ITERS:-4}
RATE=${RATE:-1gbit}          # per node link; 1gbit = 125 MB/s: 6.4 MB in 51 ms
INTER_BW=${INTER_BW:-125MB/s} # the same rate, for the simulator
INTRA_BW=${INTRA_BW:-0.6GB/s} # gloo over a namespace's loopback on this kind of machine (measured)
VISIT=${VISIT:-4}            # tawpipe micro-batches per shard visit
BUCKET=${BUCKET:-1000000}    # megatron DDP buckets of ~1 decoder layer (0.8M parameters): overlap on this small model
BACKEND=${BACKEND:-gloo}     # the simulator as the CPU runs the libraries (nccl: what GPUs would do)
EQUAL_MEMORY=${EQUAL_MEMORY:-1}
EQUAL_MEMORY_RULE=${EQUAL_MEMORY_RULE:-whole}
EQUAL=()
[ "$EQUAL_MEMORY" = 1 ] && EQUAL=(--equal-memory --equal-memory-rule "$EQUAL_MEMORY_RULE")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/long_context_model.sh
mkdir -p "$OUT"
calibrate_times "$OUT/times.json"
STRATEGIES=${STRATEGIES:-tawpipe tawpipe-rep weipipe 1f1b interleaved pp-nodes distopt-node distopt fsdp hsdp}
python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate "$RATE" --repetitions "$REPS" --schedules $STRATEGIES \
    --train-iters "$ITERS" --warmup-iters 1 --no-recompute --tawpipe-microbatches-per-visit "$VISIT" \
    --ddp-bucket-size "$BUCKET" "${EQUAL[@]}" \
    --emulated-compute-times "$OUT/times.json" --outdir "$OUT/runs" --json "$OUT/results.json" \
    --chart "$OUT/results.png" -- "${MODEL[@]}"
if [ "$EQUAL_MEMORY" = 1 ]; then   # measured against the predictions each strategy's size was chosen by
  python tools/benchmark.py --results "$OUT/results.json"
  exit 0
fi
python tools/simulate.py --schedule "$(echo $STRATEGIES | tr ' ' ,)" --ranks 4 --groups 2 --num-layers 8 \
    --hidden-size 256 --num-attention-heads 4 --seq-length 3072 --micro-batch-size 1 --num-microbatches 4 \
    --vocab-size 2048 --dtype-bytes 4 --no-recompute --chunk "$VISIT" --virtual-stages 2 \
    --measured-times "$OUT/times.json" --intra-bw "$INTRA_BW" --inter-bw "$INTER_BW" --backend "$BACKEND" \
    --json > "$OUT/simulated.json"
python tools/benchmark.py --compare-simulated "$OUT/simulated.json" --results "$OUT/results.json"
