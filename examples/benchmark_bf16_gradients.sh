#!/bin/bash
# bf16 main gradients against fp32 ones: bytes and memory of TawPipe and the distributed optimizer on an
# emulated 2 x 2 cluster (root), emulated compute. Each strategy runs with and without its bf16 gradient
# option (tools/benchmark.py --bf16-gradients). Results: examples/results/bf16_gradients_2x2_1gbit.json.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama_flags.sh
MODEL=("${LLAMA_FLAGS[@]}" --num-layers 8 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4
       --seq-length 3072 --max-position-embeddings 3072 --micro-batch-size 1 --global-batch-size 8 --mock-data
       --tokenizer-type NullTokenizer --vocab-size 2047 --lr 1e-4 --log-interval 1000 --eval-iters 0
       --num-workers 0 --bf16)
OUT=${OUT:-runs/bf16_gradients}
for G in "" "--bf16-gradients"; do
  python tools/benchmark.py --nodes 2 --ranks-per-node 2 --rate 1gbit --schedules tawpipe distopt \
    --repetitions 1 --train-iters 3 --warmup-iters 1 --no-recompute --ddp-bucket-size 1000000 \
    --emulated-compute-times examples/results/long_context_times.json --outdir "$OUT/runs${G}" \
    --json "$OUT/result${G:-_fp32}.json" $G -- "${MODEL[@]}"
done
