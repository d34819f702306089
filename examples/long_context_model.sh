# The long-context model and emulated device of the emulated-cluster benchmarks (sourced by
# examples/benchmark_long_context.sh, benchmark_tensor_parallel.sh, benchmark_auto_layout.sh, ...): MODEL, the
# pretrain_llama.py flags every strategy shares; calibrate_times FILE, which writes the emulated compute times
# (PEAK TFLOP/s at efficiency 1 -> 24.4 ms per layer forward at 0.4); model_with LAYERS GBS, which sets
# CELL_MODEL to MODEL with that many layers and that global batch.
source examples/llama_flags.sh
PEAK=${PEAK:-0.4}
MODEL=("${LLAMA_FLAGS[@]}" --num-layers 8 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4 --seq-length 3072 --max-position-embeddings 3072
       --micro-batch-size 1 --global-batch-size 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 2047
       --lr 1e-4 --log-interval 1000 --eval-iters 0 --num-workers 0)
calibrate_times() {
  python tools/calibrate.py --output "$1" --from-cost-model --peak-tflops "$PEAK" --efficiency 1 \
      "${LLAMA_FLAGS[@]}" --ffn-hidden-size 704 --hidden-size 256 --num-attention-heads 4 --seq-length 3072 \
      --micro-batch-size 1 --vocab-size 2048 --num-layers 8 "${@:2}"
}
model_with() {
  CELL_MODEL=()
  local i
  for ((i = 0; i < ${#MODEL[@]}; i++)); do
    case "${MODEL[i]}" in
      --num-layers) CELL_MODEL+=(--num-layers "$1"); i=$((i + 1)) ;;
      --global-batch-size) CELL_MODEL+=(--global-batch-size "$2"); i=$((i + 1)) ;;
      *) CELL_MODEL+=("${MODEL[i]}") ;;
    esac
  done
}
