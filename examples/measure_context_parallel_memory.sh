#!/usr/bin/env bash
# What one micro-batch's forward keeps for its backward per rank at context-parallel sizes 1, 2 and 4, one
# model and sequence (tools/measure_cp_memory.py; CPU ranks with gloo, or GPUs with NCCL under torchrun).
# C = 1 runs twice: with Megatron-LM's default attention mask from the data loader (the sdpa layers then take
# the explicit mask) and with --no-create-attention-mask-in-dataloader (causal by the mask type, as the
# context-parallel runs are). Writes examples/results/cp_memory_${SEQ}.jsonl.
#   SEQ=4096 bash examples/measure_context_parallel_memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${SEQ:-4096}
OUT=${OUT:-examples/results/cp_memory_${SEQ}.jsonl}
: > "$OUT"
MODEL=(--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope --hidden-dropout 0.0
       --attention-dropout 0.0 --untie-embeddings-and-output-weights --num-layers 4 --hidden-size 128
       --num-attention-heads 4 --group-query-attention --num-query-groups 2 --ffn-hidden-size 352
       --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size 512 --mock-data --tokenizer-type NullTokenizer
       --micro-batch-size 1 --train-iters 2 --lr 1e-4 --log-interval 100 --eval-iters 0 --eval-interval 1000
       --num-workers 0)
run() {   # RANKS CP EXTRA...
    local ranks=$1 cp=$2
    shift 2
    torchrun --nproc-per-node "$ranks" --master-port "${MASTER_PORT:-29531}" tools/measure_cp_memory.py --out "$OUT" \
        "${MODEL[@]}" --global-batch-size "$((ranks / cp))" --context-parallel-size "$cp" "$@" 2>/dev/null | grep '^{'
}
run 2 1
run 2 1 --no-create-attention-mask-in-dataloader
run 2 2
run 4 4
echo "wrote $OUT"
