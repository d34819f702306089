#!/usr/bin/env bash
# Multi-node with plain torchrun: run this on every node with the same MASTER_ADDR and its own NODE_RANK.
#   MASTER_ADDR=node0 NODE_RANK=0 NNODES=2 GPUS_PER_NODE=8 SCHEDULE=tawpipe bash examples/pretrain_llama_multinode.sh
# SCHEDULE: tawpipe, weipipe, 1f1b, interleaved, or hsdp, fsdp, distopt-node, pp-nodes
# On CPU nodes set BACKEND=gloo (and GLOO_SOCKET_IFNAME to the inter-node interface).
# Weight-passing schedules take one group per node by default (--tawpipe-num-groups = NNODES).
# TP=2/4/8: tensor parallelism inside each node, with --sequence-parallel (every schedule; for tawpipe
# and weipipe each group of TP ranks is one rank of the weight pipeline).
# A failed run is relaunched up to MAX_RESTARTS (default 3) times from the latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama_flags.sh

# NCCL and CUDA settings the weight-passing plans rely on (docs/nccl.md, "What a GPU run relies on"):
# the caching allocator grows segments instead of synchronising the device to free cached blocks when
# memory runs short (a device-wide sync while peers wait on this rank can hang), and NCCL's launch order
# is left per communicator (NCCL_LAUNCH_ORDER_IMPLICIT=1 is refused for plans that need it so).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:?set NODE_RANK to the index of this node}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SCHEDULE=${SCHEDULE:-1f1b}
WORLD=$((NNODES * GPUS_PER_NODE))
TP=${TP:-1}
PP=${PP:-$((WORLD / TP))}
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN=${HIDDEN:-4096}
FFN=${FFN:-11008}
HEADS=${HEADS:-32}
SEQ=${SEQ:-16384}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((WORLD * 8))}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
BACKEND=${BACKEND:-nccl}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_SIZE=${VOCAB_SIZE:-32000}
OUT_DIR=${OUT_DIR:-runs/llama_multinode}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-500}
EVAL_ITERS=${EVAL_ITERS:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
MAX_RESTARTS=${MAX_RESTARTS:-3}      # relaunches after a failure, each resuming from the latest checkpoint

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi
# SCHEDULE is a pipeline schedule or one of the hierarchical strategies practitioners use on such
# clusters (see docs/benchmarks-and-results.md, "Results: every strategy"): hsdp, fsdp, distopt-node, pp-nodes.
DISTOPT=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
PIPELINE_SCHEDULE=1f1b
case "$SCHEDULE" in
    weipipe) PIPELINE_SCHEDULE=weipipe; PP_ARGS=(--pipeline-model-parallel-size 1) ;;
    tawpipe) PIPELINE_SCHEDULE=tawpipe; PP_ARGS=(--pipeline-model-parallel-size 1 --tawpipe-num-groups "$NNODES") ;;
    hsdp) PP_ARGS=(--use-torch-fsdp2 --num-distributed-optimizer-instances "$NNODES") ;;
    fsdp) PP_ARGS=(--use-torch-fsdp2) ;;
    distopt-node) PP_ARGS=("${DISTOPT[@]}" --num-distributed-optimizer-instances "$NNODES") ;;
    pp-nodes) PP_ARGS=(--pipeline-model-parallel-size "$NNODES" "${DISTOPT[@]}") ;;
    *) PIPELINE_SCHEDULE=$SCHEDULE; PP_ARGS=(--pipeline-model-parallel-size "$PP") ;;
esac
TP_ARGS=()
[ "$TP" -gt 1 ] && TP_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel)
PRECISION=(--bf16)
[ "$BACKEND" = gloo ] && PRECISION=()

source examples/restarts.sh
run_with_restarts torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_llama.py \
    --pipeline-schedule "$PIPELINE_SCHEDULE" "${PP_ARGS[@]}" "${TP_ARGS[@]}" --distributed-backend "$BACKEND" \
    "${LLAMA_FLAGS[@]}" \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --untie-embeddings-and-output-weights \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters "${WARMUP_ITERS:-100}" --lr-decay-style cosine --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
    "${PRECISION[@]}" "${DATA_ARGS[@]}" --split 969,30,1 \
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" \
    --save "$OUT_DIR/checkpoints" --load "$OUT_DIR/checkpoints" --save-interval "$SAVE_INTERVAL" \
    --metrics-file "$OUT_DIR/metrics.jsonl" "$@"
