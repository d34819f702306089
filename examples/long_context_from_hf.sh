#!/usr/bin/env bash
# Long-context continued pretraining from Hugging Face weights, with TawPipe across nodes:
#   1. import the Hugging Face model (tools/hf_checkpoint.py import: a release checkpoint + model_flags.txt),
#   2. train at a longer sequence with a larger rope base and/or Llama 3.x rope scaling (--finetune: the
#      weights only; the rope settings come from these flags, not from the checkpoint),
#   3. export the trained checkpoint as a Hugging Face model (tools/hf_checkpoint.py export).
# On every node, with the same MASTER_ADDR and its own NODE_RANK (OUT_DIR on a shared filesystem):
#   HF_MODEL=/models/Llama-3.1-8B SEQ=65536 ROTARY_BASE=2000000 DATA_PATH=/data/corpus_text_document \
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 bash examples/long_context_from_hf.sh
# On one CPU machine: HF_MODEL=... NNODES=1 NPROC=2 NUM_GROUPS=2 BACKEND=gloo SEQ=256 TRAIN_ITERS=2 bash ...
# ROTARY_BASE / ROPE_SCALING_FACTOR empty keep the model's; NO_ROPE_SCALING=1 drops Llama 3.x's scaling.
# Without DATA_PATH the run uses mock data. More pretrain_llama.py flags follow the script's name.
# A relaunch resumes from OUT_DIR/checkpoints once it holds a checkpoint (not from the import).
set -euo pipefail
cd "$(dirname "$0")/.."

# This command as typed (the settings given in the environment, then the flags): the summary's resume line.
LAUNCH=""
for var in HF_MODEL OUT_DIR SEQ ROTARY_BASE ROPE_SCALING_FACTOR NO_ROPE_SCALING NNODES NODE_RANK MASTER_ADDR \
           MASTER_PORT NPROC GPUS_PER_NODE NUM_GROUPS BACKEND MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS LR SAVE_INTERVAL \
           DATA_PATH; do
    [ -z "${!var+set}" ] || LAUNCH+="$var=$(printf '%q' "${!var}") "
done
LAUNCH+="bash examples/long_context_from_hf.sh"
[ $# -eq 0 ] || LAUNCH+=" $(printf '%q ' "$@" | sed 's/ $//')"
export TAWPIPE_LAUNCH_COMMAND=$LAUNCH

HF_MODEL=${HF_MODEL:?set HF_MODEL to a Hugging Face model directory (config.json, *.safetensors)}
OUT_DIR=${OUT_DIR:-runs/long_context}
SEQ=${SEQ:-32768}
ROTARY_BASE=${ROTARY_BASE:-}
ROPE_SCALING_FACTOR=${ROPE_SCALING_FACTOR:-}
NO_ROPE_SCALING=${NO_ROPE_SCALING:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC:-${GPUS_PER_NODE:-8}}
NUM_GROUPS=${NUM_GROUPS:-$NNODES}        # TawPipe's groups: one per node
BACKEND=${BACKEND:-nccl}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((NNODES * NPROC))}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-2e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
DATA_PATH=${DATA_PATH:-}
IMPORTED=$OUT_DIR/imported
CHECKPOINTS=$OUT_DIR/checkpoints
EXPORTED=$OUT_DIR/hf_export
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# 1. Import, once (node 0); the other nodes wait for it.
if [ "$NODE_RANK" = 0 ] && [ ! -f "$IMPORTED/model_flags.txt" ]; then
    python tools/hf_checkpoint.py import "$HF_MODEL" "$IMPORTED"
fi
until [ -f "$IMPORTED/model_flags.txt" ]; do sleep 5; done

# 2. The model's flags, then what this run changes: sequence length, rope base and scaling.
read -r -a MODEL_FLAGS < "$IMPORTED/model_flags.txt"
if [ "$NO_ROPE_SCALING" = 1 ]; then
    KEPT=()
    for flag in "${MODEL_FLAGS[@]}"; do [ "$flag" = --use-rope-scaling ] || KEPT+=("$flag"); done
    MODEL_FLAGS=("${KEPT[@]}")
fi
ROPE=(--seq-length "$SEQ" --max-position-embeddings "$SEQ")
[ -z "$ROTARY_BASE" ] || ROPE+=(--rotary-base "$ROTARY_BASE")
[ -z "$ROPE_SCALING_FACTOR" ] || ROPE+=(--use-rope-scaling --rope-scaling-factor "$ROPE_SCALING_FACTOR")
if [ -n "$DATA_PATH" ]; then DATA=(--data-path "$DATA_PATH" --split 99,1,0); else DATA=(--mock-data); fi
if [ -f "$CHECKPOINTS/latest_checkpointed_iteration.txt" ]; then
    LOAD=(--load "$CHECKPOINTS")                  # a relaunch resumes the continued pretraining
else
    LOAD=(--load "$IMPORTED" --finetune)          # the imported weights; optimizer and schedule start afresh
fi
PRECISION=(--bf16)
[ "$BACKEND" = gloo ] && PRECISION=()

python -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_llama.py \
    "${MODEL_FLAGS[@]}" "${ROPE[@]}" \
    --pipeline-schedule tawpipe --pipeline-model-parallel-size 1 --tawpipe-num-groups "$NUM_GROUPS" \
    --distributed-backend "$BACKEND" "${PRECISION[@]}" "${DATA[@]}" "${LOAD[@]}" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
    --lr "$LR" --min-lr "$(python -c "print($LR / 10)")" --lr-warmup-iters "${WARMUP_ITERS:-0}" \
    --lr-decay-style cosine --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --num-workers 0 \
    --eval-iters 0 --log-interval "${LOG_INTERVAL:-10}" \
    --save "$CHECKPOINTS" --save-interval "$SAVE_INTERVAL" --metrics-file "$OUT_DIR/metrics.jsonl" "$@"

# 3. Export the latest checkpoint as a Hugging Face model (node 0).
if [ "$NODE_RANK" = 0 ]; then
    python tools/hf_checkpoint.py export "$CHECKPOINTS" "$EXPORTED"
fi
