#!/usr/bin/env bash
# Quick start on one CPU machine: build the embedded default corpus and tokenizer
# (Python standard-library docstrings, no network), then pre-train a small Llama
# on several local gloo ranks. Every size can be overridden from the environment:
#   NPROC=4 TRAIN_ITERS=200 bash examples/quickstart_cpu.sh
# More flags for pretrain_llama.py follow the script's name, e.g. --load runs/quickstart/checkpoints.
# The job ends on a summary: final loss, metrics and checkpoints, the command that resumes, what to try next.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama_flags.sh

# This command as typed (the sizes given in the environment, then the flags): the summary's resume line.
SIZES=(NPROC SCHEDULE PP NUM_GROUPS NUM_LAYERS HIDDEN FFN HEADS SEQ MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS LR_WARMUP
       DATA_DIR OUT_DIR)
LAUNCH=""
for var in "${SIZES[@]}"; do
    [ -z "${!var+set}" ] || LAUNCH+="$var=$(printf '%q' "${!var}") "
done
LAUNCH+="bash examples/quickstart_cpu.sh"
[ $# -eq 0 ] || LAUNCH+=" $(printf '%q ' "$@" | sed 's/ $//')"

NPROC=${NPROC:-4}
SCHEDULE=${SCHEDULE:-tawpipe}
PP=${PP:-2}            # pipeline size for the native schedules (1f1b, interleaved)
NUM_GROUPS=${NUM_GROUPS:-2}    # emulated nodes for tawpipe/weipipe
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN=${HIDDEN:-128}
FFN=${FFN:-$(( (8 * HIDDEN / 3 + 63) / 64 * 64 ))}   # Llama's 8/3 x hidden, rounded up to 64
HEADS=${HEADS:-4}
SEQ=${SEQ:-128}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
TRAIN_ITERS=${TRAIN_ITERS:-100}
LR_WARMUP=${LR_WARMUP:-$(( TRAIN_ITERS / 10 ))}   # 10% of the iterations (--lr-warmup-iters)
DATA_DIR=${DATA_DIR:-data/default}
OUT_DIR=${OUT_DIR:-runs/quickstart}

python tools/build_default_corpus.py --output-dir "$DATA_DIR"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT_DIR"
case " $* " in
    *" --load "*|*" --load="*) ;;                 # resuming: the new iterations are appended
    *) rm -f "$OUT_DIR/metrics.jsonl" ;;
esac
case "$SCHEDULE" in
    tawpipe|weipipe) PARALLEL=(--tawpipe-num-groups "$NUM_GROUPS"); OTHER="SCHEDULE=1f1b" ;;
    *) PARALLEL=(--pipeline-model-parallel-size "$PP"); OTHER="SCHEDULE=tawpipe" ;;
esac
export TAWPIPE_LAUNCH_COMMAND=$LAUNCH
export TAWPIPE_NEXT_STEPS="another schedule on the same model and data: $OTHER OUT_DIR=${OUT_DIR}-${OTHER#SCHEDULE=} bash examples/quickstart_cpu.sh (1f1b, interleaved, weipipe, tawpipe)
TawPipe against native megatron-core, loss for loss: bash examples/compare_tawpipe_native.sh
several machines: examples/pretrain_llama_multinode.sh (docs/pretrain-llama-and-megatron-lm.md)"
python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_llama.py \
    --pipeline-schedule "$SCHEDULE" "${PARALLEL[@]}" \
    "${LLAMA_FLAGS[@]}" \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters "$LR_WARMUP" --lr-decay-style cosine \
    --adam-beta2 0.95 --num-workers 0 --weight-decay 0.01 --clip-grad 1.0 --untie-embeddings-and-output-weights \
    --data-path "$DATA_DIR/corpus_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/tokenizer.model" \
    --log-interval 10 --eval-interval 50 --eval-iters 2 \
    --save "$OUT_DIR/checkpoints" --save-interval 50 \
    --metrics-file "$OUT_DIR/metrics.jsonl" "$@"
