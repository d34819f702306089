#!/usr/bin/env bash
# Long-context pre-training (32k-128k tokens) with plain torchrun, as a Megatron-LM long-context script runs it:
# each sequence split over CP ranks inside a node (--context-parallel-size), tensor parallelism with sequence
# parallelism beside it (TP x CP <= GPUs per node), full recompute, megatron's distributed optimizer, bf16.
# Run it on every node with the same MASTER_ADDR and its own NODE_RANK:
#   MASTER_ADDR=node0 NODE_RANK=0 NNODES=4 GPUS_PER_NODE=8 SEQ=65536 CP=4 TP=2 bash examples/pretrain_llama_long_context.sh
# The defaults are Llama-3-8B at 32k on one node of 8 GPUs (CP 4 x TP 2). What to set for a model, sequence and
# cluster: docs/long-context.md (and tools/simulate.py --advise). On CPU ranks (a smoke run), e.g.:
#   BACKEND=gloo GPUS_PER_NODE=2 CP=2 TP=1 NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 KV_HEADS=2 SEQ=512 \
#       GLOBAL_BATCH=2 TRAIN_ITERS=2 WARMUP_ITERS=1 PRECISION= bash examples/pretrain_llama_long_context.sh
# DATA_PATH / TOKENIZER_MODEL point at Megatron .bin/.idx data and a SentencePiece model; empty: mock data.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama_flags.sh
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
BACKEND=${BACKEND:-nccl}
CP=${CP:-4}
TP=${TP:-2}
SCHEDULE=${SCHEDULE:-1f1b}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN=${HIDDEN:-4096}
FFN=${FFN:-14336}
HEADS=${HEADS:-32}
KV_HEADS=${KV_HEADS:-8}
SEQ=${SEQ:-32768}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-3e-4}
PRECISION=${PRECISION---bf16}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_SIZE=${VOCAB_SIZE:-128256}
OUT_DIR=${OUT_DIR:-runs/llama_long_context}

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi
SP_ARGS=()
[ "$TP" -gt 1 ] && SP_ARGS=(--sequence-parallel)

mkdir -p "$OUT_DIR"
MAX_RESTARTS=${MAX_RESTARTS:-3}      # relaunches after a failure, each resuming from the latest checkpoint
source examples/restarts.sh
# shellcheck disable=SC2086
run_with_restarts torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_llama.py \
    --distributed-backend "$BACKEND" --pipeline-schedule "$SCHEDULE" --pipeline-model-parallel-size "$PP" \
    --context-parallel-size "$CP" --cp-comm-type p2p --tensor-model-parallel-size "$TP" "${SP_ARGS[@]}" \
    "${LLAMA_FLAGS[@]}" --group-query-attention --num-query-groups "$KV_HEADS" \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --rotary-base 500000 --untie-embeddings-and-output-weights \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
    --lr "$LR" --min-lr "$(python -c "print($LR/10)")" --lr-warmup-iters "${WARMUP_ITERS:-100}" --lr-decay-style cosine \
    --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 $PRECISION \
    "${DATA_ARGS[@]}" --split 969,30,1 \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-500}" --eval-iters "${EVAL_ITERS:-10}" \
    --save "$OUT_DIR/checkpoints" --load "$OUT_DIR/checkpoints" --save-interval "${SAVE_INTERVAL:-500}" \
    --metrics-file "$OUT_DIR/metrics.jsonl" "$@"
