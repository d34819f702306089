#!/usr/bin/env bash
# Single node, several GPUs (NCCL). Sizes come from the environment, e.g.
#   GPUS=8 SCHEDULE=1f1b PP=8 NUM_LAYERS=32 HIDDEN=4096 SEQ=16384 bash examples/pretrain_llama_gpu.sh
# DATA_PATH / TOKENIZER_MODEL point at Megatron .bin/.idx data and a SentencePiece model;
# leave DATA_PATH empty for mock data.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama_flags.sh

# NCCL and CUDA settings the weight-passing plans rely on (docs/nccl.md, "What a GPU run relies on"):
# the caching allocator grows segments instead of synchronising the device to free cached blocks when
# memory runs short (a device-wide sync while peers wait on this rank can hang), and NCCL's launch order
# is left per communicator (NCCL_LAUNCH_ORDER_IMPLICIT=1 is refused for plans that need it so).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

GPUS=${GPUS:-8}
SCHEDULE=${SCHEDULE:-1f1b}
PP=${PP:-$GPUS}
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN=${HIDDEN:-4096}
FFN=${FFN:-11008}
HEADS=${HEADS:-32}
SEQ=${SEQ:-8192}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-3e-4}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_SIZE=${VOCAB_SIZE:-32000}
OUT_DIR=${OUT_DIR:-runs/llama_gpu}

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi
if [ "$SCHEDULE" = weipipe ] || [ "$SCHEDULE" = tawpipe ]; then
    PP_ARGS=(--pipeline-model-parallel-size 1)
else
    PP_ARGS=(--pipeline-model-parallel-size "$PP")
fi

mkdir -p "$OUT_DIR"
MAX_RESTARTS=${MAX_RESTARTS:-3}      # relaunches after a failure, each resuming from the latest checkpoint
source examples/restarts.sh
run_with_restarts torchrun --nproc-per-node "$GPUS" pretrain_llama.py \
    --pipeline-schedule "$SCHEDULE" "${PP_ARGS[@]}" \
    "${LLAMA_FLAGS[@]}" \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --untie-embeddings-and-output-weights \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
    --lr "$LR" --min-lr "$(python -c "print($LR/10)")" --lr-warmup-iters "${WARMUP_ITERS:-100}" --lr-decay-style cosine --adam-beta2 0.95 \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    "${DATA_ARGS[@]}" --split 969,30,1 \
    --log-interval 10 --eval-interval 500 --eval-iters 10 \
    --save "$OUT_DIR/checkpoints" --load "$OUT_DIR/checkpoints" --save-interval 500 \
    --metrics-file "$OUT_DIR/metrics.jsonl" "$@"
