#!/usr/bin/env bash
# The equivalence users can check themselves: TawPipe on 4 CPU ranks (2 groups) and
# native Megatron without pipelining on 1 rank train the same model on the same data
# and global batch; their per-iteration losses agree to 1e-5.
#   bash examples/compare_tawpipe_native.sh            (SCHEDULE=weipipe for WeiPipe)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-runs/compare}
SCHEDULE=${SCHEDULE:-tawpipe}
ITERS=${ITERS:-5}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source examples/llama_flags.sh
COMMON=("${LLAMA_FLAGS[@]}" --num-layers 8 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
        --micro-batch-size 1 --global-batch-size 16 --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4
        --lr-warmup-iters 1 --lr-decay-style cosine --adam-beta2 0.95 --num-workers 0 --clip-grad 1.0 --seed 1234 --untie-embeddings-and-output-weights
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 1 --eval-iters 0)
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/$SCHEDULE.jsonl" "$OUT_DIR/native.jsonl"
python -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_llama.py "${COMMON[@]}" \
    --pipeline-schedule "$SCHEDULE" --tawpipe-num-groups 2 --metrics-file "$OUT_DIR/$SCHEDULE.jsonl"
python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_llama.py "${COMMON[@]}" \
    --pipeline-schedule 1f1b --pipeline-model-parallel-size 1 --metrics-file "$OUT_DIR/native.jsonl"
python tools/compare_metrics.py "$OUT_DIR/$SCHEDULE.jsonl" "$OUT_DIR/native.jsonl" --rtol 1e-5
